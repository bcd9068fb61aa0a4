"""Paged-attention and KV-cache kernels: CUDA C sources loaded with CuPy on a
GPU, and a torch reference with the same signatures that is the CPU path and
the test oracle."""

from kernels.dispatch import paged_attention, reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
