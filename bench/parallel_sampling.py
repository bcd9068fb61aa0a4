"""Parallel sampling against separate requests: KV blocks and throughput.

One request with ``n`` choices against ``n`` separate requests with the same prompt,
each run alone on a fresh engine over the same runner (the real model by default),
with prefix caching on and off: the most KV blocks in use at once, the prompt tokens
the model computed, and output tokens per second. With ``n`` choices the prompt is
prefilled once and its blocks are shared by reference count, the last one copied on
write (worker/engine/parallel_sampling.py); separate requests admitted together each
prefill it and hold their own copy.

Usage: ``python -m bench.parallel_sampling [--n 8] [--prompt-tokens 512] [--max-tokens 64] [--model tiny]``
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time

from bench.options import add_out_option
from bench.report import context, write_stamped_csv
from bench.targets.engine import EngineTargetSettings, build_engine, load
from worker.engine.engine import EngineRequest
from worker.engine.sampling_params import SamplingParams


def run(engine, requests: list[EngineRequest]) -> dict:
    """Run ``requests`` to completion; peak used blocks, prompt tokens computed (positions
    below the prompt's length fed to the model), tok/s."""
    for r in requests:
        assert engine.add_request(r).ok, r.request_id
    prompt_len = len(requests[0].prompt_token_ids)
    peak = computed = generated = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        last = engine.last_schedule
        if last is not None and not last.is_empty:
            computed += sum(max(0, min(c.start_pos + len(c.token_ids), prompt_len) - c.start_pos)
                            for c in last.model_input.chunks)
        peak = max(peak, engine.block_manager.num_used_blocks)
        generated += sum(len(o.token_ids) for o in outputs)
    elapsed = time.perf_counter() - started
    return {"peak_used_blocks": peak, "prefill_tokens": computed, "output_tokens": generated,
            "seconds": round(elapsed, 3), "tok_s": round(generated / elapsed, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="model spec, or 'tiny' (random weights)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.parallel_sampling " + shlex.join(argv if argv is not None else sys.argv[1:]))
    settings = EngineTargetSettings(model=args.model, max_batch_size=max(args.n, 1))
    runner, tokenizer = load(settings)
    words = tokenizer.encode(" ".join(["the history of the city and its river"] * args.prompt_tokens))
    prompt = words[: args.prompt_tokens]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    cases = {
        f"one request, n={args.n}": lambda: [EngineRequest("g", prompt, params, n=args.n)],
        f"{args.n} separate requests": lambda: [EngineRequest(f"r{i}", prompt, SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, seed=7 + i, ignore_eos=True)) for i in range(args.n)],
    }
    rows = []
    print(f"{'case':<24} {'prefix cache':>12} {'peak blocks':>11} {'prefill tok':>11} {'out tok':>8} {'tok/s':>8}")
    for prefix_cache in (True, False):
        case_settings = dataclasses.replace(settings, prefix_cache=prefix_cache)
        for name, requests in cases.items():
            engine = build_engine(runner, tokenizer, case_settings, "continuous")
            result = {"case": name, "prefix_cache": prefix_cache, **run(engine, requests())}
            rows.append(result)
            print(f"{name:<24} {'on' if prefix_cache else 'off':>12} {result['peak_used_blocks']:>11} "
                  f"{result['prefill_tokens']:>11} {result['output_tokens']:>8} {result['tok_s']:>8}")
    path = write_stamped_csv(rows, ctx, args.out, "parallel-sampling")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
