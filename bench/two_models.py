"""Two models sharing one machine: each alone, then both at once, and what co-locating costs
(issue 44 item 9, second half).

A platform team that serves two models from one machine wants to know whether the two cost
more together than the cores they are given apart. Each model runs in its own process, as two
workers would (its own weights, KV cache, torch thread pool and Python interpreter: in-process
engines on two threads would share one GIL and one OpenMP pool, which no deployment does), on the
engine-level harness (``LLMEngine`` driven closed-loop, as :mod:`bench.targets.engine` builds it;
no Redis, gateway or sockets, whose cost is the same alone or together). Each process gets
``--threads`` threads (default: the cores this process may use, halved: the cores split between
the two), and with ``--pin`` its own CPUs (``taskset``-style: the first ``--threads`` for A, the
next for B), as a cpuset would split them.

Cases, in turn (``--rounds`` times, the samples of a case pooled over its rounds):

- ``alone``: model A runs the workload while B's process waits idle; then B while A waits;
- ``both``: A and B start the same workload at the same instant.

The workload per model: ``--requests`` bench prompts (bench/prompts.jsonl, the model's chat
template), ``--batch`` at a time (the next added as one finishes), ``--max-tokens`` greedy tokens
each, EOS ignored. Reported per model: output tok/s (tokens over the span from the start to its
last token), TTFT p50 (a request's first token after it was added) and ITL p50 (gaps between a
request's outputs); for ``both`` the aggregate (both models' tokens over the span from the start
to the last token of either) and ``vs alone``: each model's tok/s both at once over alone, and
the aggregate over the sum of the two alone figures (1.0: co-locating costs nothing beyond the
split of the cores; below it, the two slow each other through shared caches, memory bandwidth
or the scheduler). TTFT and ITL ``vs alone`` are ratios of the p50s (above 1: slower together).
Each row records the 1-minute load average when its case started: a shared machine shows there.

Model B defaults to a copy of model A's file in a temporary folder (``--model-b copy``): the same
cost per token, so ``vs alone`` reads directly as the cost of co-location, and another file, so
the two processes share no weight pages in memory or caches, as two different models would not
(the same file would be mapped once by the page cache and flatter the result). The tiny random
model of the tests (``--model-b tiny``, or tests/helpers/tiny_hf_model.py's folder) costs almost
nothing per token and would hide the contention. Any model spec is accepted for either.

Usage: ``python -m bench.two_models [--model-a SPEC] [--model-b copy|SPEC] [--threads N] [--pin]
[--requests 8] [--batch 4] [--max-tokens 64] [--rounds 1]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.options import add_out_option
from bench.report import context, write_stamped_csv
from common.worker_options import add_worker_options

#: Seconds between the parent's "go" and the start, so both processes begin at one instant.
START_DELAY_S = 0.3


@dataclass
class Samples:
    """One model's measurements in one case, pooled over its rounds.

    Attributes:
        tokens: output tokens generated.
        seconds: summed spans, start to the model's last token, s.
        ttft_s: per request, first token minus the time it was added, s.
        itl_s: gaps between a request's consecutive outputs, s (zero gaps left out).
        spans: per round, ``(start, end)`` in ``time.monotonic`` seconds (comparable across processes).
    """

    tokens: int = 0
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)

    def add(self, result: dict) -> None:
        """Pool one round's result (:func:`_closed_loop`)."""
        self.tokens += result["tokens"]
        self.seconds += result["end"] - result["start"]
        self.ttft_s += result["ttft_s"]
        self.itl_s += result["itl_s"]
        self.spans.append((result["start"], result["end"]))

    @property
    def tok_s(self) -> float:
        """Output tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _p50_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 2) if values else 0.0


def _closed_loop(engine, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """Run ``prompts`` through ``engine``, ``batch`` at a time, greedy for ``max_tokens`` each
    (:func:`bench.closed_loop.run_closed` on ``time.monotonic``, comparable across processes);
    returns tokens, start/end, TTFTs and ITLs in seconds."""
    from bench.closed_loop import run_closed

    run = run_closed(engine, prompts, max_tokens, batch, clock=time.monotonic)
    times = run.token_times
    end = max((t[-1] for t in times.values() if t), default=run.started + run.seconds)
    return {"tokens": run.output_tokens, "start": run.started, "end": end,
            "ttft_s": [t[0] - run.added[rid] for rid, t in times.items() if t],
            "itl_s": [b - a for t in times.values() for a, b in zip(t, t[1:]) if b > a]}


def _serve(conn, spec: str, threads: int, cpus: list[int] | None, batch: int, kv_cache_mib: int,
           prompts: list[str], max_tokens: int) -> None:
    """A model's process: load it with ``threads`` threads (on ``cpus`` when given), say
    ``("ready", dtype)``, then run the workload at each ``("go", start_at)`` and send its result,
    until ``None``."""
    import torch

    from bench.targets.engine import EngineTargetSettings, build_engine, chat_token_ids, dtype_label, load

    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    settings = EngineTargetSettings(model=spec, max_batch_size=batch, kv_cache_mib=kv_cache_mib)
    runner, tokenizer = load(settings)
    runner.warmup(32)
    ids = [chat_token_ids(tokenizer, p) for p in prompts]
    conn.send(("ready", dtype_label(runner)))
    while (message := conn.recv()) is not None:
        _, start_at = message
        engine = build_engine(runner, tokenizer, settings, "continuous")
        time.sleep(max(0.0, start_at - time.monotonic()))
        conn.send(_closed_loop(engine, ids, max_tokens, batch))


class ModelProcess:
    """One model's process (:func:`_serve`), started with ``spawn`` (no torch state forked)."""

    def __init__(self, label: str, spec: str, name: str, threads: int, cpus: list[int] | None, args,
                 prompts: list[str]):
        self.label, self.spec, self.name = label, spec, name
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, name=f"bench-{label}", daemon=True,
                                   args=(child, spec, threads, cpus, args.batch, args.kv_cache_mib, prompts,
                                         args.max_tokens))
        self.process.start()
        child.close()
        self.dtype = ""

    def wait_ready(self) -> None:
        """Block until the model is loaded. Raises RuntimeError when its process died."""
        try:
            _, self.dtype = self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"model {self.label} ({self.spec}) did not load (exit {self.process.exitcode})") from exc

    def go(self, start_at: float) -> None:
        self.conn.send(("go", start_at))

    def result(self) -> dict:
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _second_model(spec_a: str | None, spec_b: str, tmp: Path) -> str:
    """Model B's spec: ``copy`` is a copy of model A's file (or folder) in ``tmp``; anything
    else is taken as given."""
    if spec_b != "copy":
        return spec_b
    if spec_a == "tiny":
        return "tiny"  # seeded random weights built in each process: nothing shared already
    from common.model_files import resolve_model_path

    source = resolve_model_path(spec_a)
    target = tmp / "model-b" / source.name
    target.parent.mkdir()
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)
    return str(target)


def _name(spec: str | None) -> str:
    from common.served_model import default_served_name

    return "tiny-random" if spec == "tiny" else default_served_name(spec)


def _threads(requested: int | None) -> int:
    if requested is not None:
        return requested
    from worker.serve.cpu_threads import choose_threads

    return max(1, choose_threads().threads // 2)


def measure(a: ModelProcess, b: ModelProcess, rounds: int) -> tuple[dict[tuple[str, str], Samples], dict[str, float]]:
    """``({(case, label): Samples}, {case: mean 1-minute load average at its starts})`` for
    ``alone`` (A, then B) and ``both``, ``rounds`` times in turn."""
    samples: dict[tuple[str, str], Samples] = {}
    loads: dict[str, list[float]] = {}
    for _ in range(rounds):
        for case, who in (("alone", (a,)), ("alone", (b,)), ("both", (a, b))):
            loads.setdefault(case, []).append(os.getloadavg()[0])
            start_at = time.monotonic() + START_DELAY_S
            for model in who:
                model.go(start_at)
            for model in who:
                samples.setdefault((case, model.label), Samples()).add(model.result())
    return samples, {case: round(statistics.mean(v), 2) for case, v in loads.items()}


def rows_of(samples: dict[tuple[str, str], Samples], models: list[ModelProcess], loads: dict[str, float],
            common: dict) -> list[dict]:
    """The table's rows: each model alone, each model both at once, the aggregate of both."""
    rows = []
    alone = {m.label: samples[("alone", m.label)] for m in models}
    for case in ("alone", "both"):
        for m in models:
            s, base = samples[(case, m.label)], alone[m.label]
            ttft, itl = _p50_ms(s.ttft_s), _p50_ms(s.itl_s)
            rows.append({"case": case, "model": m.label, "name": m.name, "dtype": m.dtype,
                         "tokens": s.tokens, "tok_s": round(s.tok_s, 1), "ttft_p50_ms": ttft, "itl_p50_ms": itl,
                         "tok_s_vs_alone": round(s.tok_s / base.tok_s, 3) if base.tok_s else 0.0,
                         "ttft_vs_alone": round(ttft / _p50_ms(base.ttft_s), 2) if base.ttft_s else 0.0,
                         "itl_vs_alone": round(itl / _p50_ms(base.itl_s), 2) if base.itl_s else 0.0,
                         "loadavg_1m": loads[case], **common})
    both = [samples[("both", m.label)] for m in models]
    spans = [max(end_a, end_b) - min(start_a, start_b)  # per round: the start to either's last token
             for (start_a, end_a), (start_b, end_b) in zip(both[0].spans, both[1].spans)]
    aggregate = sum(s.tokens for s in both) / sum(spans)
    split = sum(s.tok_s for s in alone.values())
    pooled = Samples(ttft_s=[t for s in both for t in s.ttft_s], itl_s=[t for s in both for t in s.itl_s])
    alone_pooled = Samples(ttft_s=[t for s in alone.values() for t in s.ttft_s],
                           itl_s=[t for s in alone.values() for t in s.itl_s])
    ttft, itl = _p50_ms(pooled.ttft_s), _p50_ms(pooled.itl_s)
    rows.append({"case": "both", "model": "A+B", "name": "aggregate", "dtype": models[0].dtype,
                 "tokens": sum(s.tokens for s in both), "tok_s": round(aggregate, 1), "ttft_p50_ms": ttft,
                 "itl_p50_ms": itl, "tok_s_vs_alone": round(aggregate / split, 3) if split else 0.0,
                 "ttft_vs_alone": round(ttft / _p50_ms(alone_pooled.ttft_s), 2) if alone_pooled.ttft_s else 0.0,
                 "itl_vs_alone": round(itl / _p50_ms(alone_pooled.itl_s), 2) if alone_pooled.itl_s else 0.0,
                 "loadavg_1m": loads["both"], **common})
    return rows


def table(rows: list[dict]) -> list[str]:
    """The printed table, one line per row (the aggregate's ``vs alone``: over the sum of the two alone)."""
    lines = [f"{'case':<6} {'model':<5} {'name':<30} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} "
             f"{'x tok/s':>8} {'x TTFT':>7} {'x ITL':>6} {'load 1m':>7}"]
    for r in rows:
        lines.append(f"{r['case']:<6} {r['model']:<5} {r['name'][:30]:<30} {r['tok_s']:>7} {r['ttft_p50_ms']:>9} "
                     f"{r['itl_p50_ms']:>8} {r['tok_s_vs_alone']:>8} {r['ttft_vs_alone']:>7} {r['itl_vs_alone']:>6} "
                     f"{r['loadavg_1m']:>7}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-a", default=None, help="model A's spec (default SmolLM2-135M-Instruct; tiny: random)")
    parser.add_argument("--model-b", default="copy",
                        help="model B's spec, or copy (default): a copy of model A's file, sharing no pages")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per model (default: this process's cores halved, at least 1)")
    parser.add_argument("--pin", action="store_true", help="give each model its own CPUs (A the first --threads)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    add_worker_options(parser, ["kv_cache_mib"], {"kv_cache_mib": {"default": 128, "help": "each model's KV cache, MiB"}})
    add_out_option(parser, "the stamped CSV and its printed table (.txt)")
    args = parser.parse_args(argv)
    ctx = context("python -m bench.two_models " + shlex.join(argv if argv is not None else sys.argv[1:]))
    from bench.spec_decode import bench_prompts

    threads = _threads(args.threads)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2 * threads:
        raise SystemExit(f"--pin needs {2 * threads} CPUs for two models of {threads} threads, "
                         f"this process has {len(cpus)}")
    prompts = bench_prompts(args.requests)
    models: list[ModelProcess] = []
    with tempfile.TemporaryDirectory(prefix="bench-two-models-") as tmp:
        spec_b = _second_model(args.model_a, args.model_b, Path(tmp))
        try:
            name_b = f"{_name(args.model_a)} (copy)" if args.model_b == "copy" else _name(spec_b)
            for k, (label, spec, name) in enumerate((("A", args.model_a, _name(args.model_a)), ("B", spec_b, name_b))):
                mine = cpus[k * threads:(k + 1) * threads] if args.pin else None
                models.append(ModelProcess(label, spec, name, threads, mine, args, prompts))
            for model in models:
                model.wait_ready()
            samples, loads = measure(models[0], models[1], args.rounds)
        finally:
            for model in models:
                model.stop()
    common = {"threads": threads, "pinned": args.pin, "requests": args.requests, "batch": args.batch,
              "max_tokens": args.max_tokens, "rounds": args.rounds}
    rows = rows_of(samples, models, loads, common)
    lines = [f"two models on one machine: {threads} thread(s) each{', pinned' if args.pin else ''}; "
             f"{args.requests} requests x {args.max_tokens} tokens, {args.batch} at a time, {args.rounds} round(s); "
             f"x: both at once over alone (aggregate: over the sum of the two alone)", *table(rows)]
    for line in lines:
        print(line, flush=True)
    path = write_stamped_csv(rows, ctx, args.out, "two-models")
    path.with_suffix(".txt").write_text("\n".join([*lines, f"wrote {path}"]) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
