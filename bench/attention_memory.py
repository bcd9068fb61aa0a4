"""How much of decode attention is arithmetic and how much is waiting for memory.

The compiled CPU kernel (``inflight_kernels.paged_attention``) runs SmolLM2-135M's 30
layers of decode attention (9 query heads, 3 KV heads, head_dim 64, bfloat16 cache and
query) for ``--batch`` sequences of ``--context`` cached tokens, over per-layer caches
that together hold the worker's default 512 MiB pool, in three block layouts:

- ``scattered``: each sequence's blocks drawn at random from the pool, as a worker's
  free list hands them out after churn (the realistic case);
- ``in order``: sequence s on blocks [s * n, (s + 1) * n), as a fresh pool would give
  whole prompts;
- ``in cache``: every sequence reads the same n blocks, so the same arithmetic runs over
  about 1/batch of the bytes, which stay in L2/L3. Its time is the kernel's arithmetic;
  the difference to the other rows is time spent waiting for DRAM.

Each layout runs at every ``--threads`` count and ``--block-sizes`` value, all cases
alternating within each of ``--rounds`` rounds so machine noise hits them alike; the
table gives the best and median ms per step (30 layers) and the GB/s of keys and values
read (``batch * context * 30 * 3 * 64 * 2 bytes * 2``; for ``in cache`` the bytes the
arithmetic consumes, not DRAM traffic). Writes one CSV row per case.

Usage: ``python -m bench.attention_memory [--batch 32] [--context 256] [--threads 1,2]``
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench.options import add_out_option
from bench.profile_step import block_tables
from bench.report import context, write_stamped_csv
from worker.model.model_runner import DEFAULT_CPU_KV_BYTES

#: SmolLM2-135M's attention shape: layers, query heads, KV heads, head_dim.
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
POOL_BYTES = DEFAULT_CPU_KV_BYTES  # the worker's default KV pool on the CPU
LAYOUTS = ("scattered", "in order", "in cache")


@dataclass
class Case:
    """One (block size, layout) setup: the 30 layers' caches and the block table."""

    block_size: int
    layout: str
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    block_tables: torch.Tensor  # [batch, blocks per sequence] int32


def pool_blocks(block_size: int) -> int:
    """Blocks per layer when the 30 layers' K and V share :data:`POOL_BYTES` (bfloat16)."""
    return POOL_BYTES // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 * block_size)


def block_table(layout: str, batch: int, per_seq: int, num_blocks: int) -> torch.Tensor:
    """``[batch, per_seq]`` int32 block ids in ``layout`` (see the module docstring).

    Raises:
        ValueError: an unknown layout, or (scattered, in order) a pool of fewer than
            ``batch * per_seq`` blocks.
    """
    if layout == "in cache":
        ids = random.Random(0).sample(range(num_blocks), per_seq) * batch
        return torch.tensor(ids, dtype=torch.int32).reshape(batch, per_seq)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    # profile_step's tables, one block per "token": per_seq blocks per sequence
    return torch.tensor(block_tables(batch, per_seq, 1, num_blocks, layout == "scattered"), dtype=torch.int32)


def make_layers(block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """30 (key, value) caches ``[pool_blocks, 3, block_size, 64]`` bfloat16, random."""
    shape = (pool_blocks(block_size), KV_HEADS, block_size, HEAD_DIM)
    return [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)) for _ in range(LAYERS)]


def step_ms(case: Case, query: torch.Tensor, lens: torch.Tensor, out: torch.Tensor) -> float:
    """Wall time of the 30 layers' decode attention, ms."""
    import inflight_kernels

    start = time.perf_counter()
    for key_cache, value_cache in case.layers:
        inflight_kernels.paged_attention(query, key_cache, value_cache, case.block_tables, lens, HEAD_DIM ** -0.5,
                                         out=out)
    return (time.perf_counter() - start) * 1e3


def run(batch: int, ctx: int, block_sizes: list[int], threads: list[int], rounds: int) -> list[dict]:
    """CSV rows (see the module docstring), printing the table as it goes."""
    torch.manual_seed(0)
    cases = []
    for bs in block_sizes:
        layers = make_layers(bs)
        per_seq = -(-ctx // bs)
        cases += [Case(bs, layout, layers, block_table(layout, batch, per_seq, pool_blocks(bs))) for layout in LAYOUTS]
    query = torch.randn(batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    lens, out = torch.full((batch,), ctx, dtype=torch.int32), torch.empty_like(query)
    times: dict[tuple[int, int, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for n in threads:
                torch.set_num_threads(n)
                for case in cases:
                    step_ms(case, query, lens, out)  # warm: first touch, the thread team
                    times.setdefault((n, case.block_size, case.layout), []).append(step_ms(case, query, lens, out))
    kv_bytes = batch * ctx * LAYERS * KV_HEADS * HEAD_DIM * 2 * 2
    rows = []
    print(f"decode attention, 30 layers, {batch} sequences x {ctx} tokens, bf16, pool {POOL_BYTES >> 20} MiB")
    print("| threads | block size | layout | best ms | median ms | GB/s (best) |\n|---|---|---|---|---|---|")
    for (n, bs, layout), ms in times.items():
        row = {"threads": n, "block_size": bs, "layout": layout, "batch": batch, "context": ctx,
               "best_ms": round(min(ms), 3), "median_ms": round(statistics.median(ms), 3),
               "gb_s": round(kv_bytes / min(ms) / 1e6, 1), "rounds": rounds}
        rows.append(row)
        print(f"| {n} | {bs} | {layout} | {row['best_ms']:.2f} | {row['median_ms']:.2f} | {row['gb_s']:.1f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    parser.add_argument("--block-sizes", default="16,128", help="comma list of KV block sizes")
    parser.add_argument("--threads", default="1,2", help="comma list of intra-op thread counts")
    parser.add_argument("--rounds", type=int, default=6)
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.attention_memory " + shlex.join(argv if argv is not None else sys.argv[1:]))
    rows = run(args.batch, args.context, [int(b) for b in args.block_sizes.split(",")],
               [int(t) for t in args.threads.split(",")], args.rounds)
    print(f"wrote {write_stamped_csv(rows, ctx, args.out, 'attention-memory')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
