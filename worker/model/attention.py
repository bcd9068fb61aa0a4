"""Attention over the paged KV cache for one layer: prefill with torch SDPA,
decode through ``kernels.paged_attention``; K/V written with
``kernels.reshape_and_cache``. Same code path on CPU and CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill chunk inside the flattened token batch.

    Attributes:
        token_start, token_end: rows ``[token_start, token_end)`` of the batch.
        start_pos: tokens of this sequence already in the cache before the chunk.
        block_table: ``[num_blocks]`` int64 physical block ids of the sequence.
    """

    token_start: int
    token_end: int
    start_pos: int
    block_table: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token (-1 = skip).
        prefills: the prefill chunks, occupying the first rows of the batch.
        num_prefill_tokens: rows taken by prefills; decode rows follow.
        decode_block_tables: ``[num_decodes, max_blocks]`` int32.
        decode_context_lens: ``[num_decodes]`` int32, including the new token.
    """

    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor


def paged_attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Cache this step's K/V, then attend.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], key_cache, value_cache, span, scale)
    if meta.decode_context_lens.numel():
        p = meta.num_prefill_tokens
        kernels.paged_attention(
            q[p:], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out=out[p:]
        )
    return out


def _prefill_attention(q, k, v, key_cache, value_cache, span: PrefillSpan, scale: float) -> torch.Tensor:
    """Causal attention of a chunk; with cached context (chunked prefill,
    prefix-cache hit, resume after preemption) keys come from the pages and
    query ``i`` sees positions ``<= start_pos + i``."""
    n = q.shape[0]
    if span.start_pos == 0:
        keys, values, mask, causal = k, v, None, True
    else:
        total = span.start_pos + n
        keys = _gather_context(key_cache, span.block_table, total)
        values = _gather_context(value_cache, span.block_table, total)
        query_pos = torch.arange(span.start_pos, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(q.dtype), values.transpose(0, 1)[None].to(q.dtype),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, num_kv_heads, head_dim]`` of one sequence, read from its pages."""
    block_size = cache.shape[2]
    pages = cache[block_table[: -(-length // block_size)]]  # [B, KVH, bs, D]
    return pages.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:length]
