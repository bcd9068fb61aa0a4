"""``inflight bench``: static vs dynamic vs continuous batching side by side,
peers on the same model, and the hardware ceiling, all in one run.

Examples (see bench/README.md):
    inflight bench --target engine --batching static,dynamic,continuous --num-requests 128
    inflight bench --target engine --rate 2 --peer hf-generate --peer hf-cb --peer llama-server ./llama-server
    inflight bench --target stack --transport grpc --batching continuous
    inflight bench soak --duration-s 600     # soak with a worker restart (bench/soak.py)
    inflight bench list                      # every other benchmark, as a subcommand (bench/subcommands.py)
    inflight bench spec-decode --help        # = python -m bench.spec_decode --help
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch

from bench import ceiling, cpu_share, plots, report
from bench.metrics import SLO, RunResult
from bench.options import add_out_option
from bench.targets import engine as engine_target
from bench.workloads import (OUTPUT_DISTS, WorkloadSpec, load_prompts, make_workload, request_level_bound,
                             shared_system_prompt)
from common.cli_types import positive_int
from common.worker_options import WorkerOptions, add_worker_options
from worker.engine.engine_config import SpeculativeConfig

PEERS = ("hf-generate", "hf-cb", "llama-server")
#: The worker's options ``inflight bench`` takes (common/worker_options.py), with its own help
#: lines and defaults: they set the engine target and the stack target's worker alike.
BENCH_WORKER_OPTIONS = {
    "model": {"help": "GGUF file or HF folder (default SmolLM2-135M-Instruct; 'tiny' = random test model)"},
    "dtype": {"choices": ["auto", "float32", "bfloat16"]},
    "kv_cache_dtype": {"help": "engine and stack KV cache element type, as the worker's (default auto)"},
    "quantization": {"help": "engine and stack weight quantization, as the worker's (default auto)"},
    "dense_weights_min_rows": {"help": "engine and stack: the worker's --dense-weights-min-rows (default auto)"},
    "stream_interval": {"help": "stack target: the worker's tokens per streamed chunk after the first (default 1; "
                                "ITL is then measured per chunk, as vLLM's benchmark does)"},
    "max_batch_size": {"default": 32, "help": "sequences per batch, every mode and peer"},
    "max_wait_ms": {"help": "dynamic batching wait, ms"},
    "max_num_batched_tokens": {"type": positive_int, "default": None, "metavar": "N",
                               "help": "engine and stack per-step token budget (chunked prefill), as the worker's "
                                       "(default: the worker's default)"},
    "speculative_config": {"help": "engine target: speculative decoding, as the worker's --speculative-config "
                                   "(default off)"},
    "kv_cache_mib": {"help": "engine KV pool, MiB (default: the worker's, 512 on the CPU, 90%% of free GPU memory)"},
    "no_prefix_cache": {"help": "same as --prefix-cache off"},
    "device": {"default": "cpu", "help": "the engine target's device: cpu (default, so runs stay comparable across "
                                         "machines), cuda, cuda:N or auto; not with --peer or --target stack"},
}


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``inflight bench``."""
    p = argparse.ArgumentParser(prog="inflight bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["engine", "stack", "none"], default="engine")
    p.add_argument("--batching", default="static,dynamic,continuous", help="comma-separated modes, run side by side")
    p.add_argument("--peer", nargs="+", action="append", default=[], metavar="NAME [PATH]",
                   help="hf-generate | hf-cb | llama-server PATH (repeatable)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: closed, all at t=0)")
    p.add_argument("--min-tokens", type=int, default=16, help="output length lower bound, tokens")
    p.add_argument("--max-tokens", type=int, default=512, help="output length upper bound, tokens")
    p.add_argument("--output-dist", choices=OUTPUT_DISTS, default="uniform",
                   help="output length distribution over [--min-tokens, --max-tokens]; log-uniform = long-tailed, "
                        "most answers short (bench/workloads.py)")
    p.add_argument("--seed", type=int, default=0)
    add_worker_options(p, ["model", "dtype", "kv_cache_dtype", "quantization", "dense_weights_min_rows",
                           "stream_interval", "max_batch_size", "max_wait_ms", "max_num_batched_tokens",
                           "speculative_config", "kv_cache_mib"], BENCH_WORKER_OPTIONS)
    p.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                   help="prepend one fixed system prompt of about N tokens to every request's chat (engine, hf peers)")
    p.add_argument("--prefix-cache", default=None, metavar="on|off|on,off",
                   help="engine prefix caching; 'on,off' runs each mode both ways (rows <mode>+pc, <mode>-nopc) "
                        "and prints the hit ratio and TTFT gain (default: on, rows unlabelled)")
    add_worker_options(p, ["no_prefix_cache", "device"], BENCH_WORKER_OPTIONS)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--url", default=None, help="REST base URL of a running stack (with --api-key)")
    p.add_argument("--grpc", default=None, help="gRPC host:port of a running stack (with --api-key)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--metrics-url", default=None, help="worker /metrics of a running stack")
    p.add_argument("--transport", choices=["rest", "grpc"], default="rest")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput SLO on TTFT, seconds")
    p.add_argument("--slo-itl-s", type=float, default=0.25, help="goodput SLO on TPOT, seconds/token")
    p.add_argument("--ceiling-n", type=int, default=None,
                   help="matrix size of the FLOP/s probe (default 2048 on the CPU, 8192 on a GPU)")
    p.add_argument("--ceiling-mib", type=int, default=256, help="tensor size of the bandwidth probe, MiB")
    add_out_option(p)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    return p


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip() and m.strip() != "none"]
    bad = [m for m in modes if m not in ("static", "dynamic", "continuous")]
    if bad:
        raise SystemExit(f"unknown batching mode(s): {bad}")
    return modes


def _prefix_cache(args) -> list[tuple[bool, str]]:
    """(enabled, row-label suffix) per prefix-cache setting to run."""
    if args.no_prefix_cache:
        if args.prefix_cache not in (None, "off"):
            raise SystemExit("--no-prefix-cache contradicts --prefix-cache " + args.prefix_cache)
        return [(False, "-nopc")]
    if args.prefix_cache is None:
        return [(True, "")]
    values = [v.strip() for v in args.prefix_cache.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) != len(values):
        raise SystemExit(f"bad --prefix-cache {args.prefix_cache!r}: use on, off or on,off")
    return [(v == "on", "+pc" if v == "on" else "-nopc") for v in values]


def _engine_runs(args, settings, runner, tokenizer, requests) -> list[RunResult]:
    runner.warmup(min(256, runner.context_length - 1))
    results = []
    for m in _modes(args.batching):
        for on, suffix in _prefix_cache(args):
            s = dataclasses.replace(settings, prefix_cache=on)
            engine = engine_target.build_engine(runner, tokenizer, s, m)
            results.append(_with_cpu(lambda: engine_target.run(engine, tokenizer, requests, mode=m + suffix)))
    return results


def _stack_runs(args, dtype: str, label: str, requests) -> list[RunResult]:
    """The stack target's rows: an already running stack (``--url``/``--grpc``) or a fresh
    local one per mode whose worker runs in ``dtype``; ``label`` fills the rows' dtype cell."""
    from bench.targets import stack

    if args.url or args.grpc:
        target = stack.StackTarget(args.transport, args.url or "", args.grpc or "", args.api_key or "",
                                   args.metrics_url)
        return [_with_cpu(lambda: stack.run(target, requests, "as-running", args.max_batch_size, label))]
    results = []
    for mode in _modes(args.batching):
        if mode == "static" and len(requests) % args.max_batch_size:
            print(f"warning: static batching never starts the last partial batch; "
                  f"{len(requests)} requests is not a multiple of {args.max_batch_size}", file=sys.stderr)
        options = WorkerOptions.from_args(args).replace(batching=mode, dtype=dtype)
        with stack.started_stack(options) as target:
            target = dataclasses.replace(target, transport=args.transport)
            results.append(_with_cpu(lambda: stack.run(target, requests, mode, args.max_batch_size, label)))
    return results


def _with_cpu(run) -> RunResult:
    """``run()``'s result with the CPU seconds this process and its children (a started stack) spent in it."""
    before, t0 = cpu_share.snapshot(), time.perf_counter()
    result = run()
    return dataclasses.replace(result, cpu=cpu_share.share(before, cpu_share.snapshot(), time.perf_counter() - t0))


def _prompt_ids(tokenizer, requests) -> dict[str, list[int]]:
    return {r.request_id: engine_target.chat_token_ids(tokenizer, r.prompt, r.system) for r in requests}


def _peer_runs(args, runner, tokenizer, requests) -> list[RunResult]:
    if not args.peer:  # the peers' modules need the gRPC stubs and transformers: import only when asked
        return []
    from bench.peers import hf_cb, hf_generate, llama_server

    results, hf_model = [], None
    dtype = str(runner.dtype).removeprefix("torch.")
    for peer in args.peer:
        name = peer[0]
        if name in ("hf-generate", "hf-cb"):
            hf_model = hf_model or _hf_model(args, runner.dtype)
            module = hf_generate if name == "hf-generate" else hf_cb
            results.append(module.run(hf_model, _prompt_ids(tokenizer, requests), requests, args.max_batch_size, dtype))
        elif name == "llama-server":
            # room for the prompt: the benchmark's short prompts plus the shared prefix, doubled
            # for a tokenizer that splits it more finely than the count it was made to
            s = llama_server.LlamaServerSettings(Path(peer[1]), _gguf(args), args.max_batch_size,
                                                 threads=args.threads or torch_threads(),
                                                 ctx_per_slot=args.max_tokens + 512 + 2 * args.shared_prefix_tokens,
                                                 log=args.out / "llama-server.log",
                                                 cache_prompt=any(on for on, _ in _prefix_cache(args)))
            results.append(llama_server.run(s, requests))
    return results


def torch_threads() -> int:
    """The thread count torch uses here (all cores unless --threads), so llama-server
    gets the same cores as the engine it is compared with."""
    import torch

    return torch.get_num_threads()


def _gguf(args) -> Path:
    from common.model_files import resolve_model_path

    return resolve_model_path(args.model)


def _hf_model(args, dtype: torch.dtype):
    if args.model == "tiny":
        from bench.tiny import tiny_hf_model

        return tiny_hf_model().to(dtype)
    from bench.peers.hf_generate import load_hf_model

    return load_hf_model(_gguf(args), dtype)


def _device_type(spec: str) -> str:
    """"cpu" or "cuda" for ``--device`` (resolved as the engine target would; raises SystemExit if unusable)."""
    from worker.model.device import resolve_device

    try:
        return resolve_device(spec).type
    except ValueError as exc:
        raise SystemExit(f"inflight bench: {exc}") from None


def _validate(args) -> None:
    for peer in args.peer:
        if peer[0] not in PEERS or (peer[0] == "llama-server") != (len(peer) == 2) or len(peer) > 2:
            raise SystemExit(f"bad --peer {' '.join(peer)}: use hf-generate, hf-cb or llama-server PATH")
    if (args.url or args.grpc) and not args.api_key:
        raise SystemExit("--url/--grpc need --api-key")
    if (args.peer or args.target != "engine") and _device_type(args.device) != "cpu":
        raise SystemExit("--device: the engine target alone (peers run on the CPU; a started stack's "
                         "worker picks its own device, see `inflight worker --device`)")
    if args.shared_prefix_tokens < 0:
        raise SystemExit("--shared-prefix-tokens must be >= 0")
    if args.shared_prefix_tokens and args.target == "stack":
        raise SystemExit("--shared-prefix-tokens: engine target and its peers only (the stack's client sends "
                         "the user turn alone)")
    _prefix_cache(args)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write CSV and PNG under ``--out``. Returns an exit code.
    ``<subcommand> …`` runs that benchmark instead (``soak``, ``spec-decode``, …:
    :mod:`bench.subcommands`), ``list`` names them."""
    from bench import subcommands

    if argv and argv[0] == "list":
        print(subcommands.listing())
        return 0
    if argv and argv[0] in subcommands.SUBCOMMANDS:
        return subcommands.run(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    _validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = WorkloadSpec(args.num_requests, args.rate, args.min_tokens, args.max_tokens, args.seed,
                        args.shared_prefix_tokens, args.output_dist)
    requests = make_workload(spec, load_prompts())
    settings = engine_target.EngineTargetSettings(args.model, args.dtype, args.max_batch_size, args.max_wait_ms,
                                                  kv_cache_mib=args.kv_cache_mib, device=args.device,
                                                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                                                  dense_weights_min_rows=args.dense_weights_min_rows,
                                                  speculative=SpeculativeConfig.from_json(args.speculative_config),
                                                  **({"max_num_batched_tokens": args.max_num_batched_tokens}
                                                     if args.max_num_batched_tokens else {}))
    started = time.monotonic()
    try:
        runner, tokenizer = engine_target.load(settings)
    except ValueError as exc:
        raise SystemExit(f"inflight bench: {exc}") from None
    load_s = time.monotonic() - started
    if spec.shared_prefix_tokens:
        system = shared_system_prompt(tokenizer, spec.shared_prefix_tokens)
        requests = [dataclasses.replace(r, system=system) for r in requests]
    dtype = str(runner.dtype).removeprefix("torch.")
    results = []
    if args.target == "engine":
        results += _engine_runs(args, settings, runner, tokenizer, requests)
        from bench.memory import describe, resident_mib

        print(describe("inflight engine", load_s, resident_mib(), args.model) + " (after its runs)", flush=True)
    elif args.target == "stack":
        results += _stack_runs(args, dtype, engine_target.dtype_label(runner), requests)
    results += _peer_runs(args, runner, tokenizer, requests)
    n = args.ceiling_n or (8192 if runner.device.type == "cuda" else 2048)  # a 2048 product leaves a GPU idle
    hw = ceiling.measure(ceiling.matmul_dtype(runner.dtype, args.quantization), n, args.ceiling_mib * 2 ** 20,
                         runner.device)
    cost = ceiling.ModelCost(ceiling.count_params(runner.model), ceiling.weight_bytes(runner.model))
    return _report(args, argv, spec, results, hw, cost, runner.device)


def _report(args, argv, spec, results, hw, cost, device: torch.device) -> int:
    slo = SLO(args.slo_ttft_s, args.slo_itl_s)
    ctx = report.context("inflight bench " + shlex.join(argv if argv is not None else sys.argv[1:]))
    if device.type == "cuda":  # the machine that ran the engine is the GPU; the host CPU in brackets
        ctx = dataclasses.replace(ctx, cpu=f"{torch.cuda.get_device_name(device)} (host: {ctx.cpu})")
    rows = report.make_rows(results, slo, hw, cost)
    print(report.table(rows, ctx, hw, cost, spec.describe(), slo))
    print(f"request-level bound at max batch {args.max_batch_size}: continuous can reach at most "
          f"{request_level_bound(spec, args.max_batch_size):.2f}x static's tokens/s on these output lengths "
          "(E[max of a batch] / E[length], equal step cost; bench/workloads.py)")
    if not rows:
        return 1
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{args.target}-{spec.kind}{'-' + args.tag if args.tag else ''}"
    report.write_csv(rows, ctx, hw, args.out / f"{stem}.csv", spec.describe())
    plots.plot_run(results, rows, args.out / f"{stem}.png", f"{spec.describe()} · {ctx.cpu} · {ctx.commit}")
    print(f"\nwrote {args.out / stem}.csv and .png")
    return 0 if all(r.summary.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
