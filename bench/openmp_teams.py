"""Why the worker loads, warms up and steps its model on one thread (worker/serve/engine_thread.py).

Runs the same closed continuous-batching workload on the in-process engine
three ways, each in a fresh process, and prints tokens/s and the cores the
process used:

- ``main``: load, warm-up and steps on the main thread (one OpenMP team);
- ``split``: load and warm-up on the main thread, steps on a second thread,
  as the worker did before (two OpenMP teams);
- ``engine-thread``: load, warm-up and steps on a second thread, as the worker
  does now (one team).

    python -m bench.openmp_teams [--num-requests 64] [--max-tokens 256] [--model PATH]

Results: bench/RESULTS.md run 12.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

VARIANTS = ("main", "split", "engine-thread")


def _run(variant: str, num_requests: int, max_tokens: int, model: str | None) -> tuple[float, float]:
    """(output tokens/s, cores used) of one variant, in this process."""
    from bench.targets import engine as engine_target
    from bench.workloads import WorkloadSpec, load_prompts, make_workload

    settings = engine_target.EngineTargetSettings(model, "auto", 32, 5.0)
    pool = ThreadPoolExecutor(1)

    def setup():
        runner, tokenizer = engine_target.load(settings)
        runner.warmup(min(256, runner.context_length - 1))
        return tokenizer, engine_target.build_engine(runner, tokenizer, settings, "continuous")

    tokenizer, engine = pool.submit(setup).result() if variant == "engine-thread" else setup()
    if variant != "main":
        step = engine.step
        engine.step = lambda: pool.submit(step).result()
    requests = make_workload(WorkloadSpec(num_requests, None, 16, max_tokens, 0, 0, "uniform"), load_prompts())
    t0, c0 = time.perf_counter(), time.process_time()
    result = engine_target.run(engine, tokenizer, requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(r.output_tokens for r in result.records) / wall, cpu / wall


def main(argv: list[str] | None = None) -> int:
    """Print a Markdown table, one row per variant (each in its own process)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", default=None, help="as inflight bench's (default SmolLM2-135M-Instruct)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's side
    args = p.parse_args(argv)
    if args.variant:
        print("%.1f %.2f" % _run(args.variant, args.num_requests, args.max_tokens, args.model))
        return 0
    print("| variant | tok/s | cores used |\n|---|---|---|")
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, "-m", "bench.openmp_teams", "--variant", variant,
                              "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
                              *(["--model", args.model] if args.model else [])],
                             capture_output=True, text=True, check=True).stdout.split()
        print(f"| {variant} | {out[-2]} | {out[-1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
