"""One-shot GPU check and benchmark of the CUDA kernels (inflight_kernels/cuda/ops.py).

Run on a CUDA machine with torch and CuPy (no network needed), from the repo root:

    python bench/gpu_kernels.py --out bench/results/gpu_kernels.csv

1. Correctness: ``reshape_and_cache`` and ``paged_attention`` against
   ``inflight_kernels.reference`` on fresh random inputs, outputs poisoned with NaN first
   (every element must be written; NaN never passes). Relative error =
   max|out - ref| / max|ref|, limits 1e-5 fp32, 2e-3 fp16, 1e-2 bf16. Both the
   single-pass and the split-context variants are forced on a subset of cases.
2. Timing with CUDA events: paged_attention vs torch SDPA on K/V already
   gathered into dense tensors (uniform lengths, so SDPA needs no mask), and
   reshape_and_cache; achieved GB/s (inflight_kernels.cuda.launch byte formulas) against a
   device-to-device copy measured in the same run.
Prints a table, writes one CSV (kind = check | time | copy). Total < 3 minutes
by default (``--budget-s`` stops the correctness phase early and says so).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from inflight_kernels import reference  # noqa: E402
from inflight_kernels.cuda import build, launch  # noqa: E402

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_CASE_TOKENS = 1 << 20  # cap on sum of context lengths per correctness case
DEVICE = "cuda"  # tests set "cpu" (with a stand-in for cuda_ops) to exercise the harness


@dataclass(frozen=True)
class AttnCase:
    """One paged_attention configuration; ``force_split`` None = the launch.py rule."""

    dtype: str
    head_size: int
    block_size: int
    batch: int
    max_ctx: int
    gqa: int
    num_kv_heads: int = 2
    ragged: bool = True
    force_split: bool | None = None
    logit_scale: float = 1.0


@dataclass(frozen=True)
class CacheCase:
    """One reshape_and_cache configuration (num_tokens new rows, some padding slots)."""

    dtype: str
    head_size: int
    block_size: int
    num_tokens: int
    num_kv_heads: int = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line: --out CSV path, --seed, --budget-s (seconds for checks), --quick, --dtypes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="CSV path to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=110.0, help="wall-clock cap for the correctness phase")
    p.add_argument("--quick", action="store_true", help="few cases (smoke run)")
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in args.dtypes if d not in TORCH_DTYPES]
    if bad:
        p.error(f"unknown dtypes {bad}")
    return args


def _edge_cases(dtype: str) -> list[AttnCase]:
    ctxs = (1, 7, 31, 32, 33, 511, 512, 513, 1025, 8193)
    out = [AttnCase(dtype, 128, 16, 3, c, 4, ragged=False) for c in ctxs]
    out += [AttnCase(dtype, 128, 16, 5, c, 4, force_split=s) for c in (600, 5000) for s in (True, False)]
    out.append(AttnCase(dtype, 64, 8, 4, 3000, 8, logit_scale=8.0))  # peaked softmax
    return out


def correctness_cases(dtypes: list[str], seed: int = 0, quick: bool = False) -> list[AttnCase]:
    """The paged_attention check grid: edges plus a seeded sample of batch 1..256,
    context 1..32k (ragged), GQA 1/4/8, head 64/128 (96/256 once), block 8/16/32."""
    rng = random.Random(seed)
    batches, ctxs = (1, 2, 7, 32, 64, 256), (1, 17, 100, 512, 1000, 2048, 4096, 8192, 32768)
    cases: list[AttnCase] = []
    for dtype in dtypes:
        cases += _edge_cases(dtype)[: 3 if quick else None]
        for head in (64, 128):
            for bs in (8, 16, 32):
                for _ in range(1 if quick else 3):
                    b, c = rng.choice(batches), rng.choice(ctxs)
                    while b * c > MAX_CASE_TOKENS:
                        c //= 2
                    kvh = rng.choice((1, 2, 8))
                    cases.append(AttnCase(dtype, head, bs, b, c, rng.choice((1, 4, 8)), kvh))
    if "float16" in dtypes:
        cases += [AttnCase("float16", h, 16, 4, 777, 4) for h in (96, 256)]
    return cases


def cache_cases(dtypes: list[str], quick: bool = False) -> list[CacheCase]:
    """The reshape_and_cache check grid."""
    heads = (64, 128) if quick else (64, 96, 128, 256)
    return [CacheCase(d, h, bs, n) for d in dtypes for h in heads for bs in (8, 16, 32) for n in (1, 300)]


def timing_cases() -> list[AttnCase]:
    """Representative decode shapes (uniform lengths) for the timing table."""
    shapes = ((1, 32768), (8, 4096), (64, 2048), (256, 1024), (256, 4096), (32, 16384))
    out = [AttnCase(d, 128, 16, b, c, g, 8, ragged=False)
           for d in ("float16", "bfloat16") for b, c in shapes for g in (4, 8)]
    out += [AttnCase("float16", 128, bs, 64, 2048, 4, 8, ragged=False) for bs in (8, 32)]
    out += [AttnCase("float16", 64, 16, 64, 2048, 4, 8, ragged=False)]
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| in float64; inf when out has any NaN/inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def make_attention_inputs(case: AttnCase, device: str, gen: torch.Generator):
    """Random paged inputs: caches, shuffled block tables, lengths, query."""
    dt, bs = TORCH_DTYPES[case.dtype], case.block_size
    lens = [case.max_ctx] * case.batch
    if case.ragged:
        lens = [int(x) for x in torch.randint(1, case.max_ctx + 1, (case.batch,), generator=gen)]
        lens[0] = case.max_ctx
    max_blocks = -(-case.max_ctx // bs)
    used = [-(-n // bs) for n in lens]
    num_blocks = sum(used) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(case.batch, max_blocks, dtype=torch.int32)
    pos = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[pos:pos + u]
        pos += u
    shape = (num_blocks, case.num_kv_heads, bs, case.head_size)
    kc = torch.randn(shape, device=device, dtype=dt)  # device RNG, seeded by torch.manual_seed
    vc = torch.randn(shape, device=device, dtype=dt)
    q = (torch.randn(case.batch, case.num_kv_heads * case.gqa, case.head_size, device=device)
         * case.logit_scale).to(dt)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, kc, vc, tables.to(device), ctx, lens


class _forced_split:
    """Context forcing launch.use_split_context to ``value`` (None = leave the rule)."""

    def __init__(self, value: bool | None):
        self.value, self.saved = value, launch.use_split_context

    def __enter__(self):
        if self.value is not None:
            launch.use_split_context = lambda *a, **k: self.value

    def __exit__(self, *exc):
        launch.use_split_context = self.saved


def check_attention(case: AttnCase, gen: torch.Generator) -> dict:
    """Run one case on the GPU kernel and the reference; return a result row."""
    from inflight_kernels.cuda import ops as cuda_ops

    q, kc, vc, tables, ctx, lens = make_attention_inputs(case, DEVICE, gen)
    scale = case.head_size ** -0.5
    out = torch.full_like(q, float("nan"))
    with _forced_split(case.force_split):
        cuda_ops.paged_attention(q, kc, vc, tables, ctx, scale, out=out)
    ref = reference.paged_attention(q, kc, vc, tables, ctx, scale)
    _sync()
    err = rel_error(out, ref)
    return {"kind": "check", "op": "paged_attention", **asdict(case), "sum_ctx": sum(lens),
            "rel_err": err, "limit": TOLERANCE[case.dtype], "ok": err < TOLERANCE[case.dtype]}


def check_cache(case: CacheCase, gen: torch.Generator) -> dict:
    """Scatter into NaN-poisoned caches; written slots must match the reference bit
    for bit and every other element must still be NaN."""
    from inflight_kernels.cuda import ops as cuda_ops

    dt = TORCH_DTYPES[case.dtype]
    num_blocks = -(-2 * case.num_tokens // case.block_size) + 1
    shape = (num_blocks, case.num_kv_heads, case.block_size, case.head_size)
    slots = torch.randperm(num_blocks * case.block_size, generator=gen)[: case.num_tokens]
    slots[::7] = -1
    k = torch.randn(case.num_tokens, case.num_kv_heads, case.head_size, device=DEVICE, dtype=dt)
    v = torch.randn_like(k)
    caches = [torch.full(shape, float("nan"), dtype=dt, device=DEVICE) for _ in range(4)]
    slots = slots.to(DEVICE)
    cuda_ops.reshape_and_cache(k, v, caches[0], caches[1], slots)
    reference.reshape_and_cache(k, v, caches[2], caches[3], slots)
    _sync()
    ok = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
             for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))
    return {"kind": "check", "op": "reshape_and_cache", **asdict(case), "rel_err": 0.0 if ok else math.inf,
            "limit": 0.0, "ok": ok}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy GB/s counting bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=10)
    return 2 * nbytes / ms / 1e6


def time_attention(case: AttnCase, gen: torch.Generator, copy_gbs: float) -> dict:
    """Time the kernel and SDPA (enable_gqa) on the same, already gathered, K/V."""
    from inflight_kernels.cuda import ops as cuda_ops

    q, kc, vc, tables, ctx, lens = make_attention_inputs(case, "cuda", gen)
    scale, out = case.head_size ** -0.5, torch.empty_like(q)
    plan = launch.plan_attention(case.batch, q.shape[1], case.num_kv_heads, case.head_size, case.block_size,
                                 tables.shape[1], q.element_size(), *cuda_ops.device_limits(q.device.index))
    kernel_ms = cuda_time_ms(lambda: cuda_ops.paged_attention(q, kc, vc, tables, ctx, scale, out=out))
    k = kc[tables.long()].permute(0, 2, 1, 3, 4).reshape(case.batch, case.num_kv_heads, -1, case.head_size)
    v = vc[tables.long()].permute(0, 2, 1, 3, 4).reshape(case.batch, case.num_kv_heads, -1, case.head_size)
    k, v, q4 = k[:, :, : case.max_ctx].contiguous(), v[:, :, : case.max_ctx].contiguous(), q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = cuda_time_ms(lambda: sdpa(q4, k, v, scale=scale, enable_gqa=True))
    nbytes = launch.attention_bytes(lens, q.shape[1], case.num_kv_heads, case.head_size, q.element_size(),
                                    plan.num_partitions if plan.split else 1)
    min_bytes = launch.attention_bytes(lens, q.shape[1], case.num_kv_heads, case.head_size, q.element_size())
    gbs, sdpa_gbs = nbytes / kernel_ms / 1e6, min_bytes / sdpa_ms / 1e6
    return {"kind": "time", "op": "paged_attention", **asdict(case), "split": plan.split,
            "partitions": plan.num_partitions, "kernel_ms": kernel_ms, "sdpa_ms": sdpa_ms, "bytes": nbytes,
            "kernel_gbs": gbs, "sdpa_gbs": sdpa_gbs, "copy_frac": gbs / copy_gbs}


def time_cache(case: CacheCase, copy_gbs: float) -> dict:
    """Time reshape_and_cache for ``case.num_tokens`` rows."""
    from inflight_kernels.cuda import ops as cuda_ops

    dt = TORCH_DTYPES[case.dtype]
    nb = -(-case.num_tokens // case.block_size)
    kc = torch.zeros(nb, case.num_kv_heads, case.block_size, case.head_size, dtype=dt, device="cuda")
    vc, k = torch.zeros_like(kc), torch.randn(case.num_tokens, case.num_kv_heads, case.head_size,
                                              dtype=dt, device="cuda")
    slots = torch.randperm(nb * case.block_size, device="cuda")[: case.num_tokens]
    ms = cuda_time_ms(lambda: cuda_ops.reshape_and_cache(k, k, kc, vc, slots))
    nbytes = launch.cache_write_bytes(case.num_tokens, case.num_kv_heads, case.head_size, k.element_size())
    gbs = nbytes / ms / 1e6
    return {"kind": "time", "op": "reshape_and_cache", **asdict(case), "kernel_ms": ms, "bytes": nbytes,
            "kernel_gbs": gbs, "copy_frac": gbs / copy_gbs}


def _guarded(fn, *args) -> dict:
    """Run a check; on NVRTC failure retry once with nvcc; any error becomes a failed row."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - one bad case must not hide the others
        if os.environ.get(build.BACKEND_ENV) != "nvcc" and any(
                w in type(exc).__name__.lower() for w in ("compile", "nvrtc")):
            print(f"NVRTC failed ({exc!s:.200}); retrying with nvcc", flush=True)
            os.environ[build.BACKEND_ENV] = "nvcc"
            build.get_module.cache_clear()
            return _guarded(fn, *args)
        case = args[0]
        return {"kind": "check", "op": type(case).__name__, **asdict(case), "rel_err": math.inf,
                "ok": False, "error": f"{type(exc).__name__}: {exc!s:.300}"}


def _try_time(fn, case, *args) -> dict | None:
    """A timing row, or None (reported) when the case fails: timings never hide results."""
    try:
        return fn(case, *args)
    except Exception as exc:  # noqa: BLE001
        print(f"timing failed for {case}: {type(exc).__name__}: {exc!s:.300}", flush=True)
        return None


def run_checks(args, gen: torch.Generator) -> tuple[list[dict], int]:
    """All correctness rows, and how many cases the budget skipped."""
    rows, deadline = [], time.monotonic() + args.budget_s
    todo = [(check_cache, c) for c in cache_cases(args.dtypes, args.quick)]
    todo += [(check_attention, c) for c in correctness_cases(args.dtypes, args.seed, args.quick)]
    for i, (fn, case) in enumerate(todo):
        if time.monotonic() > deadline:
            return rows, len(todo) - i
        row = _guarded(fn, case, gen)
        rows.append(row)
        if not row["ok"]:
            print(f"FAIL {row}", flush=True)
    return rows, 0


def print_table(rows: list[dict], copy_gbs: float) -> None:
    """Human summary of checks and timings."""
    checks = [r for r in rows if r["kind"] == "check"]
    bad = [r for r in checks if not r["ok"]]
    print(f"\ncorrectness: {len(checks) - len(bad)}/{len(checks)} passed; copy bandwidth {copy_gbs:.0f} GB/s")
    for op in ("reshape_and_cache", "paged_attention"):
        for dtype in TORCH_DTYPES:
            errs = [r["rel_err"] for r in checks if r["op"] == op and r["dtype"] == dtype]
            if errs:
                print(f"  {op:18s} {dtype:9s} cases {len(errs):3d}  max rel err {max(errs):.2e}")
    hdr = f"{'op':18s} {'dtype':9s} {'D':>4s} {'bs':>3s} {'B':>4s} {'ctx':>6s} {'gqa':>3s} {'split':>5s} " \
          f"{'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'sdpa ms':>8s} {'sdpa GB/s':>9s}"
    print("\n" + hdr)
    for r in (r for r in rows if r["kind"] == "time"):
        print(f"{r['op']:18s} {r['dtype']:9s} {r['head_size']:4d} {r['block_size']:3d} "
              f"{r.get('batch', r.get('num_tokens')):4d} {r.get('max_ctx', 0):6d} {r.get('gqa', 0):3d} "
              f"{str(r.get('split', '')):>5s} {r['kernel_ms']:8.4f} {r['kernel_gbs']:7.0f} "
              f"{100 * r['copy_frac']:6.1f} {r.get('sdpa_ms', float('nan')):8.4f} {r.get('sdpa_gbs', float('nan')):9.0f}")


def write_csv(path: Path, rows: list[dict], meta: dict) -> None:
    """One CSV: every row carries the run's metadata columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = list(meta)
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({**meta, **r})


def _meta() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "backend": os.environ.get(build.BACKEND_ENV, "nvrtc")}


def main(argv: list[str] | None = None) -> int:
    """Checks, then timings; exit status 1 if any check failed or was skipped."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 oracle must be fp32
    torch.manual_seed(args.seed)  # CPU and CUDA generators
    gen, t0 = torch.Generator().manual_seed(args.seed), time.monotonic()
    rows, skipped = run_checks(args, gen)
    print(f"checks took {time.monotonic() - t0:.0f} s; skipped by budget: {skipped}", flush=True)
    copy_gbs = copy_bandwidth_gbs()
    rows.append({"kind": "copy", "op": "d2d_copy", "kernel_gbs": copy_gbs})
    for case in ([] if args.quick else timing_cases()):
        rows.append(_try_time(time_attention, case, gen, copy_gbs))
    for n in (64, 4096):
        rows.append(_try_time(time_cache, CacheCase("float16", 128, 16, n, 8), copy_gbs))
    rows = [r for r in rows if r is not None]
    print_table(rows, copy_gbs)
    write_csv(args.out, rows, {**_meta(), "skipped_checks": skipped})
    print(f"total {time.monotonic() - t0:.0f} s; wrote {args.out}")
    return 0 if skipped == 0 and all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
