"""Choosing the compute dtype and the KV cache dtype at run time (``"auto"``)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import inflight_kernels

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
INT8_ACTIVATIONS = ("q8_0", "q4_1")  # the quantizations that round activations to int8 blocks
_NAMED = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo);
    empty when the file is unreadable or has none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises native bf16 math (``avx512_bf16`` or AMX
    ``amx_bf16`` in /proc/cpuinfo flags); False when the file is unreadable."""
    return bool(BF16_CPU_FLAGS & cpu_flags(cpuinfo))


@functools.cache
def cpu_has_amx() -> bool:
    """True when this machine's CPU lists AMX bf16 tiles (``amx_bf16``), where
    oneDNN's bf16 GEMMs run on them (read once per process)."""
    return "amx_bf16" in cpu_flags()


def dtype_by_name(name: str) -> torch.dtype:
    """torch dtype for a name such as "float32", "bf16" or "fp16".

    Raises:
        ValueError: unknown name.
    """
    if name not in _NAMED:
        raise ValueError(f"unknown dtype {name!r}; use 'auto' or one of {sorted(_NAMED)}")
    return _NAMED[name]


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device, hidden: int, intermediate: int) -> torch.dtype:
    """Compute dtype for ``dtype`` ("auto", a name like "bf16", or a torch dtype).

    "auto": CUDA -> bf16 when supported, else fp16. CPU -> bf16 when the CPU
    has native bf16 math (avx512_bf16 or AMX, :func:`cpu_has_bf16`; faster than
    float32 per decode step on such a CPU: bench/RESULTS.md, "Machine", above run 1),
    float32 otherwise. The choice depends on the hardware only, never on a
    timing taken under load, so identical workers compute identically (a
    continuation resumed on another worker continues the same greedy text).

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return dtype_by_name(dtype)
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, compute: torch.dtype,
                           device: str | torch.device, head_dim: int, quantization: str = "none",
                           bf16_activations: bool = False) -> torch.dtype:
    """Element dtype of the paged KV cache for ``kv_cache_dtype`` ("auto", a
    name as in :func:`resolve_dtype`, or a torch dtype) and the compute dtype.

    "auto" is the compute dtype (vLLM's ``--kv-cache-dtype auto``), except
    with float32 compute on a CPU whose compiled decode attention is a vector
    build for the model's ``head_dim`` (:func:`inflight_kernels.cpu_fast_attention`):
    there it is float16,
    llama.cpp's default cache type (``--cache-type-k/-v f16``). Decode
    attention on the CPU streams the whole cache from memory, so half the
    bytes made a SmolLM2-135M decode step and the saturation benchmark faster
    on an AVX2 EPYC, with the same greedy tokens on the bench prompts
    (bench/RESULTS.md run 13). That kernel keeps q, scores, softmax, ``P V``
    and the output in float32; only the cached K/V are rounded (the torch
    fallback paths also round q and the probabilities, hence "auto" needs
    the kernel). Pass "float32" for a cache that matches float32 compute
    bit for bit.

    With ``quantization`` "q8_0" (or "q4_1", whose activations are the same
    int8 blocks) on a CPU whose kernel has the AVX-512 BF16
    path (:func:`inflight_kernels.cpu_bf16_dot`), "auto" is bfloat16 instead, and
    decode attention rounds the query to bfloat16 (:func:`inflight_kernels.decode_attention`):
    a faster q8_0 decode step than over the float16 cache on an AVX-512 EPYC, and greedy
    text as close to float32's as with the float16 cache (q8_0's int8 activations move it
    far more than either cache; bench/RESULTS.md run 16). The same holds for ``gguf`` with
    ``bf16_activations`` (its block products already take bfloat16-rounded
    inputs, :func:`worker.model.quantization.gguf_bf16_activations`): on an
    AVX-512 BF16 EPYC decode attention was faster over the bfloat16 cache, for a
    teacher-forced KL against float32 about that of dense bfloat16 (bench/RESULTS.md
    run 31). ``gguf`` with
    float32 activations follows float32's rule.

    Raises:
        ValueError: unknown name, or on CUDA a cache dtype other than the
            compute dtype (the CUDA kernels read and write one dtype).
    """
    on_cuda = torch.device(device).type == "cuda"
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto":
        if compute == torch.float32 and not on_cuda and inflight_kernels.cpu_fast_attention(head_dim):
            rounded = quantization in INT8_ACTIVATIONS or (quantization == "gguf" and bf16_activations)
            return torch.bfloat16 if rounded and inflight_kernels.cpu_bf16_dot() else torch.float16
        return compute
    chosen = kv_cache_dtype if isinstance(kv_cache_dtype, torch.dtype) else dtype_by_name(kv_cache_dtype)
    if on_cuda and chosen != compute:
        raise ValueError(f"kv_cache_dtype {str(chosen).removeprefix('torch.')} differs from the compute dtype "
                         f"{str(compute).removeprefix('torch.')}: on CUDA the cache must use the compute dtype "
                         "(use 'auto')")
    return chosen
