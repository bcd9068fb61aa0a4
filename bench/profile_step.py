"""Time one decode step of the real model in-process, with a breakdown.

For each batch size B (default 1/8/32/64) every sequence has ``--context``
tokens in the KV cache (real text prefilled once and copied to every sequence) and feeds one
token. Reported per step, in milliseconds, min of ``--repeats``:

- ``forward``: ``ModelRunner.execute`` (whole model incl. attention and lm_head);
- ``attention``: the decode attention of all layers, timed alone on the same shapes;
- ``kv_write``: the K/V cache writes of all layers, timed alone;
- ``lm_head``: ``[B, hidden] x [hidden, vocab]`` plus the float32 cast;
- ``sample``: the sampler on the step's logits (``--sampling``: greedy, or
  temperature 0.8 with top-p 0.9);
- ``tok/s``: ``B / (forward + sample)``.

``--compare ROOT`` runs this script alternately from this checkout and from
``ROOT`` (e.g. an export of an older commit) in fresh processes, ``--rounds``
times, and prints both tables (min over rounds) and the per-cell ratio
old/new, so machine noise hits both alike.

Usage: ``python -m bench.profile_step --dtype bfloat16 [--compare /tmp/base]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = ("forward", "attention", "kv_write", "lm_head", "sample")


def best_ms(fn, repeats: int) -> float:
    """Min wall time of ``fn()`` over ``repeats`` calls after one warm call, ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _decode_input(batch: int, context: int, block_size: int):
    """``ModelInput`` of ``batch`` decodes at position ``context - 1``, each on
    its own blocks."""
    from worker.runner_io import ModelInput, ScheduledChunk

    per_seq = -(-context // block_size)
    chunks = [ScheduledChunk(i, [i + 1], context - 1, list(range(i * per_seq, (i + 1) * per_seq)))
              for i in range(batch)]
    return ModelInput(decodes=chunks)


def _fill_real_context(engine, context: int, block_size: int, batch: int) -> None:
    """Prefill ``context - 1`` tokens of real text into sequence 0's blocks and
    copy them to the other ``batch - 1`` sequences' blocks, so the decode
    logits (and so the top-p nucleus sizes) are those of a real model state."""
    import torch

    from worker.runner_io import ModelInput, ScheduledChunk

    text = " ".join(json.loads(line)["prompt"] for line in (Path(__file__).parent / "prompts.jsonl").open())
    ids = (engine.tokenizer.encode(text) * context)[: context - 1]
    per_seq = -(-context // block_size)
    engine.runner.execute(ModelInput(prefills=[ScheduledChunk(0, ids, 0, list(range(per_seq)))]))
    with torch.inference_mode():
        for key_cache, value_cache in engine.runner.cache.layers:
            for cache in (key_cache, value_cache):
                cache[per_seq : batch * per_seq] = cache[:per_seq].repeat(batch - 1, 1, 1, 1)


def _params(kind: str, batch: int):
    from worker.engine.sampling_params import SamplingParams

    if kind == "greedy":
        return [SamplingParams(temperature=0)] * batch
    return [SamplingParams(temperature=0.8, top_p=0.9)] * batch


def _attention_fns():
    """(decode attention, kv write) as this checkout's attention layer calls them."""
    import inflight_kernels
    from worker.model import attention

    attend = getattr(attention, "decode_attention", inflight_kernels.paged_attention)
    write = getattr(attention, "write_kv", inflight_kernels.reshape_and_cache)
    return attend, write


def profile(dtype: str, batches: list[int], context: int, repeats: int, sampling: str,
            kv_cache_dtype: str = "auto", quantization: str = "auto") -> dict:
    """Rows of ms per component for each batch size (see module docstring)."""
    import torch

    from worker.serve.main import build_engine
    from worker.serve.settings import WorkerSettings

    try:
        from worker.model.linear import linear
    except ImportError:  # an older checkout (--compare)
        from torch.nn.functional import linear
    block_size = 16
    num_blocks = max(batches) * -(-context // block_size) + 4
    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}  # older checkouts: --compare
    if quantization != "auto":  # older checkouts (--compare) knew no "auto" and no "gguf"
        kv["quantization"] = quantization
    try:
        from worker.engine.engine_config import EngineConfig
        sizes = {"engine": EngineConfig(block_size=block_size, num_blocks=num_blocks)}
    except ImportError:  # an older checkout (--compare): the sizes were WorkerSettings fields
        sizes = {"block_size": block_size, "num_blocks": num_blocks}
    engine, _ = build_engine(WorkerSettings(dtype=dtype, kv_cache_bytes=None, **sizes, **kv))
    runner = engine.runner
    model, cfg = runner.model, runner.config
    layers = runner.cache.layers
    _fill_real_context(engine, context, block_size, max(batches))
    attend, write = _attention_fns()
    rows = {}
    with torch.inference_mode():
        for batch in batches:
            step_input = _decode_input(batch, context, block_size)
            from worker.model.model_runner import build_step

            step = build_step(step_input.decodes, 0, block_size, runner.device)
            meta = step.meta
            q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=runner.dtype)
            kv = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, dtype=runner.dtype)
            out = torch.empty_like(q)
            last = torch.randn(batch, cfg.hidden_size, dtype=runner.dtype)
            logits = runner.execute(step_input).logits
            params, idx = _params(sampling, batch), [5] * batch

            def attn_all():
                for kc, vc in layers:
                    attend(q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, model.scale, out=out)

            def write_all():
                for kc, vc in layers:
                    write(kv, kv, kc, vc, meta.slot_mapping)

            times = {
                "forward": best_ms(lambda: runner.execute(step_input), repeats),
                "attention": best_ms(attn_all, repeats),
                "kv_write": best_ms(write_all, repeats),
                "lm_head": best_ms(lambda: linear(last, model.lm_head).float(), repeats),
                "sample": best_ms(lambda: engine.sampler(logits, params, idx), repeats),
            }
            rows[batch] = times
    import worker

    return {"dtype": str(runner.dtype), "kv_cache_dtype": str(runner.cache.spec.dtype), "rows": rows,
            "quantization": getattr(model, "quantization", "none"),
            "root": str(Path(worker.__file__).resolve().parents[1])}


def _tok_s(batch: int, times: dict) -> float:
    return batch * 1e3 / (times["forward"] + times["sample"])


def format_table(result: dict, title: str) -> str:
    """Markdown table of one :func:`profile` result."""
    kv = result.get("kv_cache_dtype", result["dtype"])  # absent in an older checkout's result
    cache = "" if kv == result["dtype"] else f", KV cache {kv}"
    if result.get("quantization", "none") != "none":
        cache += f", {result['quantization']}"
    lines = [f"{title} ({result['dtype']}{cache})", "| batch | " + " | ".join(f"{c} ms" for c in COLUMNS) + " | tok/s |",
             "|" + "---|" * (len(COLUMNS) + 2)]
    for batch, times in sorted(result["rows"].items(), key=lambda kv: int(kv[0])):
        cells = " | ".join(f"{times[c]:.2f}" for c in COLUMNS)
        lines.append(f"| {batch} | {cells} | {_tok_s(int(batch), times):.0f} |")
    return "\n".join(lines)


def _run_child(root: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--dtype", args.dtype, "--context", str(args.context),
           "--repeats", str(args.repeats), "--sampling", args.sampling, "--batches", *map(str, args.batches)]
    if args.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.quantization != "auto":
        cmd += ["--quantization", args.quantization]
    env = dict(os.environ, PYTHONPATH=str(root))
    text = subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(text.strip().splitlines()[-1])


def _merge_min(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    for batch, times in new["rows"].items():
        for col, value in times.items():
            acc["rows"][batch][col] = min(acc["rows"][batch][col], value)
    return acc


def compare(args: argparse.Namespace) -> str:
    """Alternate old/new child runs; tables of min-over-rounds and old/new ratios."""
    here, other = Path(__file__).resolve().parents[1], Path(args.compare).resolve()
    new = old = None
    for _ in range(args.rounds):
        old = _merge_min(old, _run_child(other, args))
        new = _merge_min(new, _run_child(here, args))
    ratios = ["ratio old/new", "| batch | " + " | ".join(COLUMNS) + " | tok/s new/old |", "|" + "---|" * (len(COLUMNS) + 2)]
    for batch in sorted(new["rows"], key=int):
        o, n = old["rows"][batch], new["rows"][batch]
        cells = " | ".join(f"{o[c] / n[c]:.2f}x" for c in COLUMNS)
        ratios.append(f"| {batch} | {cells} | {_tok_s(int(batch), n) / _tok_s(int(batch), o):.2f}x |")
    return "\n\n".join([format_table(old, f"before ({old['root']})"), format_table(new, f"after ({new['root']})"),
                        "\n".join(ratios)])


def main(argv: list[str] | None = None) -> None:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", help="the worker's --dtype (default auto)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sampling", choices=("greedy", "top_p"), default="top_p")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the KV cache's element type, as the worker's (default auto)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "q8_0", "q4_1", "gguf"),
                        help="the worker's --quantization (lm_head column: the model's own lm_head)")
    parser.add_argument("--compare", help="another checkout root to time alternately against this one")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the raw result as one JSON line")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(args))
        return
    result = profile(args.dtype, args.batches, args.context, args.repeats, args.sampling, args.kv_cache_dtype,
                     args.quantization)
    print(json.dumps(result) if args.json else format_table(result, "decode step"))


if __name__ == "__main__":
    main()
