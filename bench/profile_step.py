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

``--block-size`` sets the KV block size (default: the timed checkout's).
``--scattered-blocks`` gives the model the worker's default 512 MiB pool and
draws each sequence's blocks from it at random, as a worker's free list does
after hours of churn; without it the pool just fits and blocks are in order.

Every table is also written as a stamped CSV under ``--out`` (one row per
batch, and per round and checkout with ``--compare``).

Usage: ``python -m bench.profile_step --dtype bfloat16 [--compare /tmp/base]``
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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


def block_tables(batch: int, context: int, block_size: int, num_blocks: int, scattered: bool) -> list[list[int]]:
    """Each sequence's block ids: ``ceil(context / block_size)`` blocks per
    sequence, consecutive sequences on consecutive blocks, or (``scattered``)
    drawn without replacement in a fixed random order from all ``num_blocks``
    blocks of the pool, as a long-running worker's free list hands them out.

    Raises:
        ValueError: the pool has fewer than ``batch * ceil(context / block_size)`` blocks.
    """
    import random

    per_seq = -(-context // block_size)
    if batch * per_seq > num_blocks:
        raise ValueError(f"{batch} sequences of {per_seq} blocks do not fit {num_blocks} blocks")
    ids = random.Random(0).sample(range(num_blocks), batch * per_seq) if scattered else range(batch * per_seq)
    ids = list(ids)
    return [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]


def decode_input(tables: list[list[int]], context: int):
    """``ModelInput`` of one decode per block table, at position ``context - 1``."""
    from worker.runner_io import ModelInput, ScheduledChunk

    return ModelInput(decodes=[ScheduledChunk(i, [i + 1], context - 1, table) for i, table in enumerate(tables)])


def _fill_real_context(engine, context: int, tables: list[list[int]]) -> None:
    """Prefill ``context - 1`` tokens of real text into the first table's blocks
    and copy them to the other tables' blocks, so the decode logits (and so the
    top-p nucleus sizes) are those of a real model state."""
    import torch

    from worker.runner_io import ModelInput, ScheduledChunk

    text = " ".join(json.loads(line)["prompt"] for line in (Path(__file__).parent / "prompts.jsonl").open())
    ids = (engine.tokenizer.encode(text) * context)[: context - 1]
    engine.runner.execute(ModelInput(prefills=[ScheduledChunk(0, ids, 0, tables[0])]))
    if len(tables) == 1:
        return
    source = torch.tensor(tables[0], dtype=torch.long)
    others = torch.tensor(tables[1:], dtype=torch.long).reshape(-1)
    with torch.inference_mode():
        for key_cache, value_cache in engine.runner.cache.layers:
            for cache in (key_cache, value_cache):
                cache[others] = cache[source].repeat(len(tables) - 1, 1, 1, 1)


def default_block_size() -> int:
    """``EngineConfig``'s default ``block_size`` (the worker's ``--block-size``) in
    the checkout being timed; 16 in checkouts that predate ``EngineConfig``."""
    import dataclasses

    try:
        from worker.engine.engine_config import EngineConfig
    except ImportError:
        return 16
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "block_size")


def _params(kind: str, batch: int):
    from worker.engine.sampling_params import SamplingParams

    if kind == "greedy":
        return [SamplingParams(temperature=0)] * batch
    return [SamplingParams(temperature=0.8, top_p=0.9)] * batch


def attention_fns():
    """(decode attention, kv write) as this checkout's attention layer calls them."""
    import inflight_kernels
    from worker.model import attention

    attend = getattr(attention, "decode_attention", inflight_kernels.paged_attention)
    write = getattr(attention, "write_kv", inflight_kernels.reshape_and_cache)
    return attend, write


def profile(dtype: str, batches: list[int], context: int, repeats: int, sampling: str,
            kv_cache_dtype: str = "auto", quantization: str = "auto", block_size: int | None = None,
            scattered: bool = False, dense_weights_min_rows: int | None = None, model: str | None = None) -> dict:
    """Rows of ms per component for each batch size (see module docstring).

    ``block_size`` None takes the checkout's CPU default. ``scattered``: the
    worker's default KV pool (512 MiB) with each sequence's blocks drawn at
    random from it; otherwise a pool just large enough, blocks in order.
    ``dense_weights_min_rows``: the worker's ``--dense-weights-min-rows`` (0: off; None: auto).
    ``model``: the worker's ``--model`` (None: the default SmolLM2 file).
    """
    import torch

    from worker.serve.main import build_engine
    from worker.serve.settings import WorkerSettings

    try:
        from worker.model.linear import linear
    except ImportError:  # an older checkout (--compare)
        from torch.nn.functional import linear
    block_size = block_size or default_block_size()
    num_blocks = None if scattered else max(batches) * -(-context // block_size) + 4
    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}  # older checkouts: --compare
    if quantization != "auto":  # older checkouts (--compare) knew no "auto" and no "gguf"
        kv["quantization"] = quantization
    if dense_weights_min_rows is not None and "dense_weights_min_rows" in WorkerSettings.__dataclass_fields__:
        kv["dense_weights_min_rows"] = dense_weights_min_rows  # older checkouts have no dense copies: as 0
    if model is not None:
        kv["model"] = model
    try:
        from worker.engine.engine_config import EngineConfig
        sizes = {"engine": EngineConfig(block_size=block_size, num_blocks=num_blocks)}
    except ImportError:  # an older checkout (--compare): the sizes were WorkerSettings fields
        sizes = {"block_size": block_size, "num_blocks": num_blocks}
    engine, _ = build_engine(WorkerSettings(dtype=dtype, kv_cache_bytes=None, **sizes, **kv))
    runner = engine.runner
    model, cfg = runner.model, runner.config
    layers = runner.cache.layers
    tables = block_tables(max(batches), context, block_size, runner.num_blocks, scattered)
    _fill_real_context(engine, context, tables)
    attend, write = attention_fns()
    rows = {}
    with torch.inference_mode():
        for batch in batches:
            step_input = decode_input(tables[:batch], context)
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
            "quantization": getattr(model, "quantization", "none"), "block_size": block_size,
            "num_blocks": runner.num_blocks, "scattered": scattered,
            "root": str(Path(worker.__file__).resolve().parents[1])}


def _tok_s(batch: int, times: dict) -> float:
    return batch * 1e3 / (times["forward"] + times["sample"])


def format_table(result: dict, title: str) -> str:
    """Markdown table of one :func:`profile` result."""
    kv = result.get("kv_cache_dtype", result["dtype"])  # absent in an older checkout's result
    cache = "" if kv == result["dtype"] else f", KV cache {kv}"
    if result.get("quantization", "none") != "none":
        cache += f", {result['quantization']}"
    if "block_size" in result:
        cache += f", block size {result['block_size']} of {result['num_blocks']} blocks"
    lines = [f"{title} ({result['dtype']}{cache})", "| batch | " + " | ".join(f"{c} ms" for c in COLUMNS) + " | tok/s |",
             "|" + "---|" * (len(COLUMNS) + 2)]
    for batch, times in sorted(result["rows"].items(), key=lambda kv: int(kv[0])):
        cells = " | ".join(f"{times[c]:.2f}" for c in COLUMNS)
        lines.append(f"| {batch} | {cells} | {_tok_s(int(batch), times):.0f} |")
    return "\n".join(lines)


def csv_rows(result: dict, checkout: str) -> list[dict]:
    """One CSV row per batch size of a :func:`profile` result (times in ms)."""
    rows = []
    for batch, times in sorted(result["rows"].items(), key=lambda kv: int(kv[0])):
        rows.append({"checkout": checkout, "batch": int(batch), "dtype": result["dtype"],
                     "kv_cache_dtype": result.get("kv_cache_dtype", result["dtype"]),
                     "quantization": result.get("quantization", "none"), "block_size": result.get("block_size", 16),
                     "num_blocks": result.get("num_blocks", ""), "scattered_blocks": result.get("scattered", False),
                     **{f"{c}_ms": round(times[c], 3) for c in COLUMNS},
                     "tok_s": round(_tok_s(int(batch), times), 1)})
    return rows


def _rows_or_auto(text: str) -> int | None:
    """argparse type of ``--dense-weights-min-rows``: ``auto`` (None) or a count >= 0 (not
    common.cli_types': --compare runs this file over older checkouts, which lack it)."""
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"auto or a row count >= 0, got {text!r}")
    return int(text)


def _child_script(root: Path) -> list[str]:
    """This file, over a checkout since the layout move (``worker/serve/``); before it, the
    checkout's own ``bench.profile_step`` (the same ``--json`` line), as this file imports
    modules such a checkout does not have."""
    if (root / "worker" / "serve").is_dir():
        return [str(Path(__file__).resolve())]
    return ["-m", "bench.profile_step"]


def _run_child(root: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, *_child_script(root), "--json", "--dtype", args.dtype, "--context", str(args.context),
           "--repeats", str(args.repeats), "--sampling", args.sampling, "--batches", *map(str, args.batches)]
    if args.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.quantization != "auto":
        cmd += ["--quantization", args.quantization]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if args.dense_weights_min_rows is not None and _child_script(root)[0] != "-m":  # a pre-layout one has none
        cmd += ["--dense-weights-min-rows", str(args.dense_weights_min_rows)]
    if args.scattered_blocks:
        cmd += ["--scattered-blocks"]
    if args.model:
        cmd += ["--model", args.model]
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


def compare(args: argparse.Namespace) -> tuple[str, list[dict]]:
    """Alternate old/new child runs (old first in odd rounds, new first in even ones); tables of
    min-over-rounds and old/new ratios,
    and CSV rows of every round (``checkout``: ``old``/``new`` and the round)."""
    here, other = Path(__file__).resolve().parents[1], Path(args.compare).resolve()
    new = old = None
    rows: list[dict] = []
    for i in range(args.rounds):
        if i % 2 == 0:  # which checkout runs first alternates, so a round's order favours neither
            before, after = _run_child(other, args), _run_child(here, args)
        else:
            after, before = _run_child(here, args), _run_child(other, args)
        rows += csv_rows(before, f"old {other} round {i + 1}") + csv_rows(after, f"new {here} round {i + 1}")
        old, new = _merge_min(old, before), _merge_min(new, after)
    ratios = ["ratio old/new", "| batch | " + " | ".join(COLUMNS) + " | tok/s new/old |", "|" + "---|" * (len(COLUMNS) + 2)]
    for batch in sorted(new["rows"], key=int):
        o, n = old["rows"][batch], new["rows"][batch]
        cells = " | ".join(f"{o[c] / n[c]:.2f}x" for c in COLUMNS)
        ratios.append(f"| {batch} | {cells} | {_tok_s(int(batch), n) / _tok_s(int(batch), o):.2f}x |")
    tables = "\n\n".join([format_table(old, f"before ({old['root']})"), format_table(new, f"after ({new['root']})"),
                          "\n".join(ratios)])
    return tables, rows


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
    parser.add_argument("--dense-weights-min-rows", type=_rows_or_auto, default=None, help="the worker's --dense-weights-min-rows (default auto, as the worker's; "
                                           "a checkout without the flag runs as with 0)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size in tokens (default: the timed checkout's CPU default)")
    parser.add_argument("--scattered-blocks", action="store_true",
                        help="the worker's default 512 MiB KV pool with each sequence's blocks drawn at random "
                             "from it, as after hours of churn (default: a pool just large enough, in order)")
    parser.add_argument("--model", default=None,
                        help="the worker's --model, e.g. a GGUF path (default: the default SmolLM2 file)")
    parser.add_argument("--compare", help="another checkout root to time alternately against this one")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the raw result as one JSON line (no CSV)")
    # Not bench.options' --out: this file also runs over another checkout (--compare), which may lack it.
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="folder of the stamped CSV (default: bench/results)")
    args = parser.parse_args(argv)
    settings = "python -m bench.profile_step " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.compare:
        tables, rows = compare(args)
        print(tables)
    else:
        result = profile(args.dtype, args.batches, args.context, args.repeats, args.sampling, args.kv_cache_dtype,
                         args.quantization, args.block_size, args.scattered_blocks, args.dense_weights_min_rows,
                         args.model)
        if args.json:
            print(json.dumps(result))
            return
        print(format_table(result, "decode step"))
        rows = csv_rows(result, result["root"])
    from bench.report import context, write_stamped_csv  # not in --json children: an older checkout's bench

    print(f"wrote {write_stamped_csv(rows, context(settings), args.out, 'profile-step')}")


if __name__ == "__main__":
    main()
