"""The engine under CPU contention: one busy process beside it, with and without the
thread governor (worker/serve/thread_governor.py).

One run, three cases on one loaded runner (the real model by default), the same
closed-loop workload each time (``--requests`` bench prompts, ``--batch`` at a time,
``--max-tokens`` greedy tokens each):

- ``alone``: nothing else running, the worker's default threads;
- ``busy, fixed threads``: a competitor (``python -c "while True: pass"``, started
  and killed by this script, on the same CPUs) with the thread count fixed, as
  ``--no-adaptive-threads``;
- ``busy, governor``: the same competitor, the governor's ``tick`` before every step
  as the worker runs it.

Reported: output tokens/s and ITL p50/p99 (gaps between a request's outputs), and
each as a ratio to ``alone``. Issue 23's target: throughput >= 0.45x and ITL p99
<= 3x alone, with one busy process on a 2-core machine.

Usage: ``python -m bench.contention [--batch 4] [--requests 8] [--max-tokens 64] [--model tiny]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import time

import torch

from bench.closed_loop import run_closed
from bench.options import add_out_option
from bench.report import context, write_stamped_csv
from bench.spec_decode import bench_prompts
from bench.targets.engine import EngineTargetSettings, build_engine, chat_token_ids, dtype_label, load
from worker.serve.cpu_threads import choose_threads
from worker.serve.thread_governor import ThreadGovernor

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def competitor(enabled: bool):
    """A busy Python process on this process's CPUs while the block runs (none when
    ``enabled`` is False); it gets a second to show in the CPU counters first."""
    if not enabled:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.sched_setaffinity(proc.pid, os.sched_getaffinity(0))
        time.sleep(1.0)
        yield
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "q8_0", "q4_1", "gguf"])
    parser.add_argument("--model", default=None, help="model spec, or 'tiny' (random weights)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.contention " + shlex.join(argv if argv is not None else sys.argv[1:]))
    threads = choose_threads().threads
    torch.set_num_threads(threads)
    settings = EngineTargetSettings(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    max_batch_size=args.batch)
    runner, tokenizer = load(settings)
    runner.warmup(64)
    prompts = [chat_token_ids(tokenizer, p) for p in bench_prompts(args.requests)]
    cases = (("alone", False, False), ("busy, fixed threads", True, False), ("busy, governor", True, True))
    rows: list[dict] = []
    print(f"{'case':<20} {'threads':>7} {'tok/s':>7} {'ITL p50':>8} {'ITL p99':>8} {'x tok/s':>8} {'x p99':>6}")
    for name, busy, governed in cases:
        torch.set_num_threads(threads)
        governor = ThreadGovernor(threads, torch.set_num_threads) if governed else None
        with competitor(busy):
            engine = build_engine(runner, tokenizer, settings, "continuous")
            result = run_closed(engine, prompts, args.max_tokens, args.batch,
                                before_step=governor.tick if governor else None)
        row = {"case": name, "threads_start": threads, "threads_end": torch.get_num_threads(),
               "dtype": dtype_label(runner), "batch": args.batch, "tok_s": round(result.tok_s, 1),
               "itl_p50_ms": round(result.itl_ms(0.5), 2), "itl_p99_ms": round(result.itl_ms(0.99), 2)}
        row["tok_s_ratio"] = round(row["tok_s"] / rows[0]["tok_s"], 3) if rows else 1.0
        row["itl_p99_ratio"] = round(row["itl_p99_ms"] / rows[0]["itl_p99_ms"], 2) if rows else 1.0
        rows.append(row)
        print(f"{name:<20} {row['threads_end']:>7} {row['tok_s']:>7} {row['itl_p50_ms']:>8} {row['itl_p99_ms']:>8} "
              f"{row['tok_s_ratio']:>8} {row['itl_p99_ratio']:>6}", flush=True)
    torch.set_num_threads(threads)
    path = write_stamped_csv(rows, ctx, args.out, "contention")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
