"""Compile options and the module cache of the CUDA kernels.

One source of truth per op in ``inflight_kernels/cuda``: templates over (dtype, head size,
block size). At run time CuPy compiles one instantiation per configuration with
NVRTC (``name_expressions``) and this module caches the ``cupy.RawModule``; tests
compile every instantiation offline with nvcc (``-DINFLIGHT_INSTANTIATE_ALL``).
CuPy is imported only inside ``get_module``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent
SOURCES = {"paged_attention": "paged_attention.cu", "reshape_and_cache": "reshape_and_cache.cu"}
# torch dtype name -> (C++ storage type, bytes per element)
DTYPES = {"float16": ("inflight::f16_t", 2), "bfloat16": ("inflight::bf16_t", 2), "float32": ("float", 4)}
HEAD_SIZES = (64, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
COMMON_OPTIONS = ("-std=c++17",)  # no fast math: expf/division stay IEEE-accurate
BACKEND_ENV = "INFLIGHT_KERNEL_BACKEND"  # "nvrtc" (default) or "nvcc"


def check_config(dtype: str, head_size: int, block_size: int) -> None:
    """Raise ValueError unless (dtype name, head_size, block_size) has kernels."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    if head_size not in HEAD_SIZES:
        raise ValueError(f"unsupported head_size {head_size}; supported: {HEAD_SIZES}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"unsupported block_size {block_size}; supported: {BLOCK_SIZES}")


def kernel_names(op: str, dtype: str, head_size: int, block_size: int) -> dict[str, str]:
    """Name expressions of ``op``'s kernels for one configuration, by role."""
    ctype = DTYPES[dtype][0]
    if op == "reshape_and_cache":
        return {"main": f"inflight::reshape_and_cache_kernel<{ctype}, {head_size}, {block_size}>"}
    if op == "paged_attention":
        return {
            "main": f"inflight::paged_attention_kernel<{ctype}, {head_size}, {block_size}>",
            "reduce": f"inflight::paged_attention_reduce_kernel<{ctype}, {head_size}>",
        }
    raise ValueError(f"unknown op {op!r}; known: {sorted(SOURCES)}")


def runtime_options() -> tuple[str, ...]:
    """Options given to CuPy's compiler (NVRTC or nvcc); the arch is CuPy's choice and
    the language level the compiler's default (C++17 in CUDA 12/13), so nothing here
    can clash with options CuPy adds itself."""
    return (f"-I{CSRC_DIR}",)


def nvcc_command(op: str, arch: str, out_path: Path) -> list[str]:
    """nvcc command compiling every configuration of ``op`` to a cubin for ``arch`` (e.g. "sm_90"),
    warnings as errors. Used by tests/inflight_kernels/test_nvcc_compile.py."""
    return [
        "nvcc", *COMMON_OPTIONS, f"-arch={arch}", "-cubin", "-Werror", "all-warnings",
        "-DINFLIGHT_INSTANTIATE_ALL", f"-I{CSRC_DIR}", "-o", str(out_path), str(CSRC_DIR / SOURCES[op]),
    ]


@functools.lru_cache(maxsize=None)
def get_module(op: str, dtype: str, head_size: int, block_size: int, device_index: int):
    """Compiled ``cupy.RawModule`` of ``op`` for one configuration on one device (cached).

    Raises ValueError for an unsupported configuration and ImportError with an
    install hint when CuPy is absent.
    """
    check_config(dtype, head_size, block_size)
    cupy = import_cupy()
    names = kernel_names(op, dtype, head_size, block_size)
    code = (CSRC_DIR / SOURCES[op]).read_text()
    backend = os.environ.get(BACKEND_ENV, "nvrtc")
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=code, options=runtime_options(), backend=backend,
                                name_expressions=tuple(names.values()))
        module.compile()
    return module


def import_cupy():
    """Import CuPy lazily; raise ImportError explaining how to get it."""
    try:
        import cupy
    except ImportError as exc:  # includes sys.modules["cupy"] = None
        raise ImportError(
            "CUDA kernels need CuPy: pip install 'inflight-serve[gpu]' (cupy-cuda12x) "
            "or the cupy wheel matching your CUDA"
        ) from exc
    return cupy
