"""CPU decode attention: padded (old), padding-free varlen (new) and the compiled C++ kernel, side by side.

Run from the repo root (about a minute):

    .venv/bin/python bench/decode_attention.py            # bf16 cache, all cores
    .venv/bin/python bench/decode_attention.py --chunk-blocks 1,4 --reps 41

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, 16-token
blocks), one layer. Batches S in {8, 32, 64} with context mixes:
``uniform512`` (every sequence 512 tokens), ``mixed16-1024`` (uniform random
in 16..1024, seeded), ``1long+short`` (one 1000-token sequence, the rest 40).
Blocks are scattered at random over the cache.

``old`` = ``inflight_kernels.paged_decode.padded_lowp_decode_attention`` (pages padded to
the longest context); ``new`` = ``varlen_decode_attention`` with its plan
built beforehand (the plan is built once per step and shared by the 30
layers; its own time is the ``plan ms`` column); ``auto`` =
``decode_attention`` with the choice the engine makes (the compiled kernel
when it is built, else ``use_varlen`` with the plan shared across layers);
``compiled`` = ``inflight_kernels.cpu.ops.paged_attention`` (``inflight_kernels/cpu``), with
``torch/compiled`` = the faster of old and new over it. They
run alternately, in rotating order, within each repetition so that the
noise of a shared machine hits all of them; the table gives medians and
``old/new`` (> 1: new faster). Writes one CSV row per case.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from inflight_kernels.cpu import ops as cpu_ops  # noqa: E402
from inflight_kernels.paged_decode import decode_attention, padded_lowp_decode_attention, use_varlen  # noqa: E402
from inflight_kernels.varlen_attention import build_varlen_plan, varlen_decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MIXES = ("uniform512", "mixed16-1024", "1long+short")


def context_lens(mix: str, s: int, gen: torch.Generator) -> torch.Tensor:
    """``[s]`` int32 context lengths of one mix (see module docstring)."""
    if mix == "uniform512":
        return torch.full((s,), 512, dtype=torch.int32)
    if mix == "mixed16-1024":
        return torch.randint(16, 1025, (s,), generator=gen, dtype=torch.int32)
    lens = torch.full((s,), 40, dtype=torch.int32)
    lens[0] = 1000
    return lens


def make_case(s: int, mix: str, dtype: torch.dtype, seed: int = 0):
    """Random query, caches, block tables (distinct scattered blocks) and lengths."""
    gen = torch.Generator().manual_seed(seed)
    lens = context_lens(mix, s, gen)
    max_blocks = -(-int(lens.max()) // BLOCK)
    num_blocks = s * max_blocks + 16
    key_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: s * max_blocks].view(s, max_blocks).to(torch.int32)
    query = torch.randn(s, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return query, key_cache, value_cache, tables, lens


def _time_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_case(s: int, mix: str, chunk_blocks: int, reps: int, dtype: torch.dtype) -> dict:
    """Median ms of old / new / auto for one case, alternating."""
    q, kc, vc, tables, lens = make_case(s, mix, dtype)
    scale = HEAD_DIM ** -0.5
    plan = build_varlen_plan(tables, lens, BLOCK, chunk_blocks)
    auto_plan = plan if use_varlen(lens, BLOCK) else False  # as AttentionMetadata.decode_plan does
    out = torch.empty_like(q)
    fns = {
        "old": lambda: padded_lowp_decode_attention(q, kc, vc, tables, lens, scale, out),
        "new": lambda: varlen_decode_attention(q, kc, vc, plan, scale, out),
        "auto": lambda: decode_attention(q, kc, vc, tables, lens, scale, out, plan=auto_plan),
        "plan": lambda: build_varlen_plan(tables, lens, BLOCK, chunk_blocks),
    }
    if cpu_ops.available():
        fns["compiled"] = lambda: cpu_ops.paged_attention(q, kc, vc, tables, lens, scale, out)
    names = list(fns)
    times = {n: [] for n in names}
    for n in names:  # warm-up
        fns[n]()
    for r in range(reps):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            times[n].append(_time_ms(fns[n]))
    med = {n: statistics.median(v) for n, v in times.items()}
    padded = s * -(-int(lens.max()) // BLOCK) * BLOCK
    return {
        "S": s, "mix": mix, "chunk_blocks": chunk_blocks, "sum_ctx": int(lens.sum()), "padded_tokens": padded,
        "waste": round(padded / max(1, int(lens.sum())), 2),
        "old_ms": round(med["old"], 3), "new_ms": round(med["new"], 3), "auto_ms": round(med["auto"], 3),
        "plan_ms": round(med["plan"], 3), "old_over_new": round(med["old"] / med["new"], 2),
        "compiled_ms": round(med.get("compiled", float("nan")), 3),
        "torch_over_compiled": round(min(med["old"], med["new"]) / med.get("compiled", float("nan")), 2),
        "reps": reps, "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
    }


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run every case, print a Markdown table, write the CSV."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--mixes", default=",".join(MIXES))
    p.add_argument("--chunk-blocks", default="1", help="comma list of blocks per pair for the new path")
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_attention.csv"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    dtype = getattr(torch, a.dtype)
    rows = []
    print(f"threads={torch.get_num_threads()} dtype={a.dtype} reps={a.reps} (medians, ms per layer call)")
    print("| S | mix | chunk | Σctx | padded | waste | old ms | new ms | old/new | auto ms | plan ms "
          "| compiled ms | torch/compiled |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in (int(x) for x in a.batches.split(",")):
        for mix in a.mixes.split(","):
            for cb in (int(x) for x in a.chunk_blocks.split(",")):
                r = run_case(s, mix, cb, a.reps, dtype)
                rows.append(r)
                print(f"| {s} | {mix} | {cb} | {r['sum_ctx']} | {r['padded_tokens']} | {r['waste']} | {r['old_ms']} "
                      f"| {r['new_ms']} | {r['old_over_new']} | {r['auto_ms']} | {r['plan_ms']} "
                      f"| {r['compiled_ms']} | {r['torch_over_compiled']} |", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
