"""Speculative decoding with n-gram drafts: acceptance, one-stream speed-up, and the
batch size where verification stops paying.

Three workloads, each run with speculation off and on, on fresh engines over one
runner (the real model by default), greedy, EOS ignored:

- ``bench``: prompts of bench/prompts.jsonl one at a time (one stream), where the
  answer seldom copies the prompt;
- ``rewrite``: "repeat / rewrite / fix this text" prompts one at a time, where
  prompt lookup pays;
- ``batch-B``: the rewrite prompts, B at a time, for B in ``--batch-sizes``, with
  ``disable_by_batch_size`` off so drafts are verified at every size: where ``on``
  falls below ``off`` is the crossover that sets the default ``disable_by_batch_size``.

Off and on alternate ``--rounds`` times per workload and the best of each is kept
(machine noise only ever slows a run). Reported per row: output tokens per second, TPOT p50 (milliseconds per output token
after the first, per request), engine steps, and the acceptance rate (accepted over
proposed draft tokens).

Usage: ``python -m bench.spec_decode [--num-speculative-tokens 4] [--max-tokens 96]
[--batch-sizes 1,2,4,8,16] [--model tiny]``
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from bench.closed_loop import run_closed
from bench.options import add_out_option
from bench.report import context, write_stamped_csv
from bench.targets.engine import EngineTargetSettings, build_engine, chat_token_ids, dtype_label, load
from worker.engine.engine_config import SpeculativeConfig

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and children were playing "
    "football near the old oak tree while their parents watched from the benches.",
    "Our team meets every Monday at nine in the small conference room. Please bring your laptop, the weekly "
    "report and any questions you have about the new release schedule.",
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * "
    "(width + height)\n",
    "The museum opens at ten in the morning and closes at six in the evening. Tickets cost twelve euros for "
    "adults and six euros for children under twelve.",
]
TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
         "Rewrite this text, keeping every sentence but fixing any mistakes:\n\n{}",
         "Copy this text and add a title line at the top:\n\n{}",
         "Repeat the following text exactly:\n\n{}"]
PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"


def rewrite_prompts() -> list[str]:
    """The rewrite workload's user turns: each passage under one task."""
    return [task.format(p) for task, p in zip(TASKS, PASSAGES)]


def bench_prompts(count: int) -> list[str]:
    """The first ``count`` prompts of bench/prompts.jsonl."""
    lines = [line for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    return [json.loads(line)["prompt"] for line in lines[:count]]


def run(engine, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """Run ``prompts`` through ``engine``, ``batch`` at a time (the next starts as one
    finishes); returns tok/s, TPOT p50 (ms), steps and acceptance rate."""
    result = run_closed(engine, prompts, max_tokens, batch)
    stats = engine.stats()
    return {"tok_s": round(result.tok_s, 1), "tpot_p50_ms": round(result.tpot_p50_ms(), 2),
            "steps": stats.num_steps, "drafts": stats.spec_num_draft_tokens,
            "accepted": stats.spec_num_accepted_tokens, "acceptance": round(stats.spec_acceptance_rate, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-bench-prompts", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=2, help="off/on alternations per workload; best kept")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "q8_0", "q4_1", "gguf"])
    parser.add_argument("--model", default=None, help="model spec, or 'tiny' (random weights)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.spec_decode " + shlex.join(argv if argv is not None else sys.argv[1:]))
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    settings = EngineTargetSettings(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    max_batch_size=max(sizes + [1]))
    runner, tokenizer = load(settings)
    spec = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens, disable_by_batch_size=0,
                             prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    encode = lambda texts: [chat_token_ids(tokenizer, t) for t in texts]  # noqa: E731
    rewrite = encode(rewrite_prompts())
    cases = [("bench", encode(bench_prompts(args.num_bench_prompts)), 1), ("rewrite", rewrite, 1)]
    cases += [(f"batch-{b}", (rewrite * (-(-2 * b // len(rewrite))))[: 2 * b], b) for b in sizes]
    runner.warmup(64)
    rows = []
    print(f"{'workload':<10} {'spec':<4} {'tok/s':>7} {'TPOT p50 ms':>11} {'steps':>6} {'accept':>7} {'speed-up':>8}")
    for name, prompts, batch in cases:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):  # off and on alternate; the best of each (noise only slows)
            for label, config in (("off", None), ("on", spec)):
                engine = build_engine(runner, tokenizer, EngineTargetSettings(
                    model=args.model, max_batch_size=batch, speculative=config), "continuous")
                result = run(engine, prompts, args.max_tokens, batch)
                if label not in best or result["tok_s"] > best[label]["tok_s"]:
                    best[label] = result
        for label in ("off", "on"):
            result = best[label]
            row = {"workload": name, "batch": batch, "spec": label,
                   "k": spec.num_speculative_tokens if label == "on" else 0, "dtype": dtype_label(runner),
                   **result, "speedup": round(result["tok_s"] / best["off"]["tok_s"], 3)}
            rows.append(row)
            print(f"{name:<10} {label:<4} {row['tok_s']:>7} {row['tpot_p50_ms']:>11} {row['steps']:>6} "
                  f"{row['acceptance']:>7} {row['speedup']:>8}", flush=True)
    path = write_stamped_csv(rows, ctx, args.out, "spec-decode")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
