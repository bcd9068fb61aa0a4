"""How long a long prompt's chunked prefill pauses the streams decoding beside it.

For each per-step token budget (``--budgets``, the worker's ``--max-num-batched-tokens``),
long-prefill threshold (``--thresholds``, the worker's ``--long-prefill-token-threshold``)
and prompt length (``--prompt-tokens``), a fresh engine over the real model decodes
``--streams`` greedy sequences, then one long prompt arrives, and one step later a
short one. Every step until the long prompt's first token is timed: the longest step
is the longest pause the running streams see, the sum is the long prompt's time to
first token; ``short_ttft_s`` is the short prompt's.
Prints a markdown table; ``--csv PATH`` also writes it.

Usage: ``python -m bench.prefill_pause --budgets 2048 512 --thresholds 0 256 --prompt-tokens 1000 6000``
"""

from __future__ import annotations

import argparse
import csv
import time

from bench.targets.engine import EngineTargetSettings, build_engine, load
from worker.engine.engine import EngineRequest
from worker.engine.sampling_params import SamplingParams

FIELDS = ("budget", "threshold", "prompt_tokens", "ttft_s", "steps", "max_step_s", "mean_step_s", "short_ttft_s")


def measure(runner, tokenizer, budget: int, prompt_tokens: int, streams: int, threshold: int = 0) -> dict:
    """One long prompt's prefill next to ``streams`` decoding sequences, and a short
    prompt's first token behind it; times in seconds.

    Raises:
        ValueError: a stream is not admitted, or the tokenizer gives fewer than
            ``prompt_tokens`` tokens for the text.
    """
    settings = EngineTargetSettings(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    engine = build_engine(runner, tokenizer, settings, "continuous")
    for i in range(streams):  # 512 tokens outlast any prefill measured here (the steps are counted)
        added = engine.add_request(EngineRequest(f"s{i}", tokenizer.encode(f"Story {i}: once upon a time"),
                                                 SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)))
        if not added.ok:
            raise ValueError(f"stream {i} not admitted: {added.reason}")
    decoding: set[str] = set()
    while len(decoding) < streams:  # every stream is decoding when the long prompt arrives
        decoding.update(o.request_id for o in engine.step() if o.token_ids)
    prompt = tokenizer.encode(" ".join(f"word{i}" for i in range(prompt_tokens)))[:prompt_tokens]
    if len(prompt) < prompt_tokens:
        raise ValueError(f"only {len(prompt)} prompt tokens")
    engine.add_request(EngineRequest("long", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
    steps: list[float] = []  # the steps until the long prompt's first token
    long_done = False
    short_added = short_ttft = None
    while not long_done or short_ttft is None:
        started = time.perf_counter()
        outs = engine.step()
        ended = time.perf_counter()
        if not long_done:
            steps.append(ended - started)
            long_done = any(o.request_id == "long" and o.finished for o in outs)
        if short_added is not None and short_ttft is None and any(o.request_id == "short" and o.token_ids
                                                                  for o in outs):
            short_ttft = ended - short_added
        if short_added is None:  # the short prompt arrives one step after the long one
            engine.add_request(EngineRequest("short", tokenizer.encode("What is the capital of France?"),
                                             SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
            short_added = time.perf_counter()
    return {"budget": budget, "threshold": threshold, "prompt_tokens": prompt_tokens, "ttft_s": round(sum(steps), 3),
            "steps": len(steps), "max_step_s": round(max(steps), 3), "mean_step_s": round(sum(steps) / len(steps), 3),
            "short_ttft_s": round(short_ttft, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 512])
    parser.add_argument("--thresholds", type=int, nargs="+", default=[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 6000])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    runner, tokenizer = load(EngineTargetSettings())
    runner.warmup(256)
    rows = [measure(runner, tokenizer, b, n, args.streams, t)
            for n in args.prompt_tokens for b in args.budgets for t in args.thresholds]
    print("| " + " | ".join(FIELDS) + " |\n|" + "---|" * len(FIELDS))
    for row in rows:
        print("| " + " | ".join(str(row[f]) for f in FIELDS) + " |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
