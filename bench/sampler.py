"""The sampler's cost per step, alone: greedy, top-p, and every logit control on.

Runs :class:`worker.engine.sampler.Sampler` on random float32 logits of the default
model's vocabulary (49,152) for each batch size and case, and prints the median
and best milliseconds of ``--repeats`` calls after a warm-up; writes a CSV stamped
with the machine, the commit and the command line. The histories for the penalties
are ``--history`` tokens per row (prompt and output halves). The ``path`` column
says which sampler ran: ``kernel`` (the compiled CPU sampler, ``inflight_kernels.sample_tokens``)
or ``torch``; ``--compare`` times both side by side, alternating call by call.

Usage: ``python -m bench.sampler [--batches 1 32 64] [--repeats 30] [--threads N] [--compare]``
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

import inflight_kernels
from bench.options import add_out_option
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


def time_case(samplers: list[Sampler], batch: int, params: SamplingParams, history: int,
              repeats: int) -> list[list[float]]:
    """Milliseconds of ``repeats`` calls of each sampler on one [batch, VOCAB] logits
    tensor, the samplers taking turns call by call (so load on a shared machine
    falls on all of them alike); one list per sampler."""
    gen = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, VOCAB, generator=gen) * 4
    half = history // 2
    prompt = [torch.randint(VOCAB, (half,), generator=gen).tolist() for _ in range(batch)]
    output = [torch.randint(VOCAB, (history - half,), generator=gen).tolist() for _ in range(batch)]
    args = (logits, [params] * batch, [history - half] * batch, prompt, output, frozenset({0}))
    for sampler in samplers:
        for _ in range(3):
            sampler(*args)
    times: list[list[float]] = [[] for _ in samplers]
    for _ in range(repeats):
        for sampler, spent in zip(samplers, times):
            started = time.perf_counter()
            sampler(*args)
            spent.append((time.perf_counter() - started) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--history", type=int, default=512, help="prompt + output tokens per row")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--compare", action="store_true",
                        help="time the compiled CPU sampler and the torch path side by side")
    add_out_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = context("python -m bench.sampler " + shlex.join(argv if argv is not None else sys.argv[1:]))
    if args.compare:
        paths = {"kernel": Sampler(use_kernel=True), "torch": Sampler(use_kernel=False)}
    else:
        paths = {"kernel" if inflight_kernels.sampler_backend(torch.zeros(1, 1)) == "cpu" else "torch": Sampler()}
    rows = []
    print(f"{'batch':>5} {'case':<16} {'path':<6} {'median ms':>10} {'best ms':>8}")
    for batch in args.batches:
        for name, params in CASES.items():
            times = time_case(list(paths.values()), batch, params, args.history, args.repeats)
            for path, spent in zip(paths, times):
                row = {"batch": batch, "case": name, "path": path, "median_ms": round(statistics.median(spent), 3),
                       "best_ms": round(min(spent), 3), "threads": torch.get_num_threads()}
                rows.append(row)
                print(f"{batch:>5} {name:<16} {path:<6} {row['median_ms']:>10.3f} {row['best_ms']:>8.3f}")
    path = write_stamped_csv(rows, ctx, args.out, "sampler")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
