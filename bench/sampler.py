"""The sampler's cost per step, alone: greedy, top-p, and every logit control on.

Runs :class:`worker.engine.sampler.Sampler` on random float32 logits of the default
model's vocabulary (49,152) for each batch size and case, and prints the median
and best milliseconds of ``--repeats`` calls after a warm-up; writes a CSV stamped
with the machine, the commit and the command line. The histories for the penalties
are ``--history`` tokens per row (prompt and output halves).

Usage: ``python -m bench.sampler [--batches 1 32 64] [--repeats 30] [--threads N]``
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.report import context, write_stamped_csv
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams

VOCAB = 49152
CONTROLS = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
                min_tokens=4, logit_bias={11: 2.0, 42: -5.0})
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "greedy+controls": SamplingParams(temperature=0.0, **CONTROLS),
    "top_p+controls": SamplingParams(temperature=0.8, top_p=0.9, **CONTROLS),
}


def time_case(sampler: Sampler, batch: int, params: SamplingParams, history: int, repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` sampler calls on one [batch, VOCAB] logits tensor."""
    gen = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, VOCAB, generator=gen) * 4
    half = history // 2
    prompt = [torch.randint(VOCAB, (half,), generator=gen).tolist() for _ in range(batch)]
    output = [torch.randint(VOCAB, (history - half,), generator=gen).tolist() for _ in range(batch)]
    args = (logits, [params] * batch, [history - half] * batch, prompt, output, frozenset({0}))
    for _ in range(3):
        sampler(*args)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sampler(*args)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--history", type=int, default=512, help="prompt + output tokens per row")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = context("python -m bench.sampler " + shlex.join(argv if argv is not None else sys.argv[1:]))
    sampler, rows = Sampler(), []
    print(f"{'batch':>5} {'case':<16} {'median ms':>10} {'best ms':>8}")
    for batch in args.batches:
        for name, params in CASES.items():
            times = time_case(sampler, batch, params, args.history, args.repeats)
            row = {"batch": batch, "case": name, "median_ms": round(statistics.median(times), 3),
                   "best_ms": round(min(times), 3), "threads": torch.get_num_threads()}
            rows.append(row)
            print(f"{batch:>5} {name:<16} {row['median_ms']:>10.3f} {row['best_ms']:>8.3f}")
    path = write_stamped_csv(rows, ctx, args.out, "sampler")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
