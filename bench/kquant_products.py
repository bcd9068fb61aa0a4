"""The K-quant product's two paths side by side, per row count: the int16 products
(``--dense-weights-min-rows 0``) against the dense path a step of many rows takes where the
build has one (``inflight_kernels.cpu_kquant_tiles``: bfloat16 tiles on AVX-512 BF16,
``kquant_bf16.h``; float32 dequantized per call on AVX2, ``kquant_f32.h``), on random valid
blocks of a Llama-3.2-1B projection's shape. The data behind ``auto``'s row count
(``worker/model/dense_weights.py`` ``AUTO_KQUANT_MIN_ROWS``).

Each row count times both paths alternately, ``--rounds`` times, and keeps each one's best (these
machines' speed moves from minute to minute; the ratio is the figure). Multiply-adds per second
are M x N x K over the call's wall time, on ``--threads`` threads.

Writes ``bench/results/<stamp>-kquant-products.csv``. Results: bench/RESULTS.md run 43.

    inflight bench kquant-products [--threads 2] [--rows 8 16 24 32 48 64 128 512]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.quant_accuracy import RESULTS_DIR

# ggml type id, bytes per 256-value super-block, offsets of its fp16 scales (ggml-common.h)
KINDS = {"Q4_K": (12, 144, (0, 2)), "Q6_K": (14, 210, (208,))}
# Llama-3.2-1B: gate/up fused (2 x 8192 rows of K 2048), down (2048 rows of K 8192), v in Q6_K
SHAPES = (("Q4_K", 16384, 2048, "gate_up"), ("Q4_K", 2048, 8192, "down"), ("Q6_K", 2048, 2048, "v, o-sized"))


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[rows, cols / 256 * bytes]`` of valid ``kind`` super-blocks: random bytes with small
    finite fp16 scales (any such block is a valid one)."""
    _, size, f16 = KINDS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset in f16:
        scale = (rng.uniform(0.5, 1.0, (rows, cols // 256)) * 1e-2).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def best_seconds(run, calls: int, rounds: int) -> list[float]:
    """Best mean seconds per call of each function in ``run``, timed alternately ``rounds`` times."""
    best = [float("inf")] * len(run)
    for _ in range(rounds):
        for i, fn in enumerate(run):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best


def measure(rows: list[int], rounds: int) -> list[dict]:
    """One dict per shape and row count: G multiply-adds/s of both paths and their ratio."""
    import inflight_kernels

    out = []
    for kind, n, k, name in SHAPES:
        w, ggml_type = random_blocks(kind, n, k), KINDS[kind][0]
        for m in rows:
            x, y = torch.randn(m, k), torch.empty(m, n)
            paths = [lambda d=d: inflight_kernels.kquant_linear(x, [w], [ggml_type], out=y, dense_min_rows=d)
                     for d in (0, 1)]
            calls = max(2, int(1e9 / (m * n * k)))
            int16, dense = best_seconds(paths, calls, rounds)
            out.append({"weight": f"{kind} {n}x{k} ({name})", "rows": m, "int16_gmacs": round(m * n * k / int16 / 1e9, 1),
                        "dense_gmacs": round(m * n * k / dense / 1e9, 1), "ratio": round(int16 / dense, 2)})
            print(f"| {out[-1]['weight']} | {m} | {out[-1]['int16_gmacs']} | {out[-1]['dense_gmacs']} | "
                  f"{out[-1]['ratio']:.2f}x |", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the CSV; 1 when the build has no dense K-quant path."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch and OpenMP threads (default 2, the worker's here)")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 128, 512])
    p.add_argument("--rounds", type=int, default=4, help="alternating timings per row count (best kept)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder of the stamped CSV (default: bench/results)")
    args = p.parse_args(argv)
    import inflight_kernels
    from bench.report import context

    tiles = inflight_kernels.cpu_kquant_tiles()
    if tiles is None:
        print("this build has no dense K-quant path (needs AVX-512 BF16, or AVX2 and FMA)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    ctx = context(" ".join(sys.argv))
    print(f"{ctx.cpu}, {args.threads} threads, commit {ctx.commit}; dense path: {tiles} tiles\n\n"
          f"| weight | rows | int16 G multiply-adds/s | {tiles} tiles | tiles against int16 |\n|---|---|---|---|---|")
    rows = measure(args.rows, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M%S')}-kquant-products.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, [*rows[0], "tiles", "threads", "commit", "cpu"])
        writer.writeheader()
        writer.writerows({**row, "tiles": tiles, "threads": args.threads, "commit": ctx.commit, "cpu": ctx.cpu}
                         for row in rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
