"""Device dispatch for the paged KV-cache ops (one code path above the kernels).

CUDA tensors go to :mod:`kernels.cuda.ops` (CuPy RawKernels, imported lazily
so CPU-only installs never import CuPy); CPU tensors to the compiled kernels of
:mod:`kernels.cpu.ops` when they are built, else to the torch reference in
:mod:`kernels.reference`. Signatures and layouts: docs/CONTRACTS.md.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.cpu import ops as cpu_ops


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the
    caches ``[num_blocks, num_kv_heads, block_size, head_dim]`` at
    ``slot_mapping`` ``[num_tokens]`` int64 (negative = skip). In place.
    See :func:`kernels.reference.reshape_and_cache`."""
    if key.is_cuda:
        from kernels.cuda import ops as cuda_ops

        return cuda_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if cpu_ops.available() and key_cache.dtype in cpu_ops.DTYPES:
        reference.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        return cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``query`` ``[num_seqs, num_heads, head_dim]`` over
    paged K/V; ``block_tables`` ``[num_seqs, max_blocks]`` int32,
    ``context_lens`` ``[num_seqs]`` int32. Returns ``out`` like ``query``.
    See :func:`kernels.reference.paged_attention`."""
    if query.is_cuda:
        from kernels.cuda import ops as cuda_ops

        return cuda_ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out)
    if cpu_ops.supports(query, key_cache):
        reference.check_attention(query, key_cache, block_tables, context_lens)
        out = torch.empty_like(query) if out is None else out
        return cpu_ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out)
    return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out)
