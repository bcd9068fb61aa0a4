"""Choosing the compute dtype at run time (``dtype="auto"``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_NAMED = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises native bf16 math (``avx512_bf16`` or AMX
    ``amx_bf16`` in /proc/cpuinfo flags); False when the file is unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(BF16_CPU_FLAGS & set(line.split(":", 1)[1].split()))
    return False


def bf16_matmul_faster(hidden: int, intermediate: int, batch_sizes=(1, 32), repeats: int = 7) -> bool:
    """Time the model's largest matmul (``[batch, hidden] x [hidden, 2*intermediate]``)
    in bf16 and float32 on the CPU, alternating the two so that noise from a
    shared machine hits both alike; True when the summed best-of-``repeats``
    time over ``batch_sizes`` is lower in bf16. Takes tens of milliseconds."""
    weight32 = torch.randn(2 * intermediate, hidden) * 0.02
    weight16 = weight32.bfloat16()
    total32 = total16 = 0.0
    for batch in batch_sizes:
        x32 = torch.randn(batch, hidden)
        x16 = x32.bfloat16()
        best32 = best16 = float("inf")
        for _ in range(repeats):
            best32 = min(best32, _time(F.linear, x32, weight32))
            best16 = min(best16, _time(F.linear, x16, weight16))
        total32, total16 = total32 + best32, total16 + best16
    return total16 < total32


def _time(fn, x, w, calls: int = 4) -> float:
    fn(x, w)  # warm caches and kernels
    start = time.perf_counter()
    for _ in range(calls):
        fn(x, w)
    return time.perf_counter() - start


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device, hidden: int, intermediate: int) -> torch.dtype:
    """Compute dtype for ``dtype`` ("auto", a name like "bf16", or a torch dtype).

    "auto": CUDA -> bf16 when supported, else fp16. CPU -> bf16 only when the
    CPU has avx512_bf16/AMX *and* :func:`bf16_matmul_faster` measures bf16
    faster on this model's shapes; float32 otherwise.

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _NAMED:
            raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {sorted(_NAMED)}")
        return _NAMED[dtype]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_has_bf16() and bf16_matmul_faster(hidden, intermediate):
        return torch.bfloat16
    return torch.float32
