"""Attention over the paged KV cache for one layer: prefill with torch SDPA (or, where the
compiled CPU decode kernel takes the shapes, through it: :func:`inflight_kernels.prefill_as_decode`),
decode with one call, :func:`inflight_kernels.decode_attention`, which chooses the kernel or
torch path. K/V written with ``inflight_kernels.reshape_and_cache``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import inflight_kernels
from inflight_kernels import VarlenPlan


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
        token_seq_lens: ``[num_tokens]`` int64, each token's sequence length at the
            end of its chunk (length-dependent RoPE scalings,
            :func:`worker.model.rope.rope_cos_sin`); None = position + 1.
    """

    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    token_seq_lens: torch.Tensor | None = None
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

    def decode_plan(self, query: torch.Tensor, key_cache: torch.Tensor) -> VarlenPlan | bool:
        """The varlen plan of the decode rows (:func:`inflight_kernels.decode_plan`), built on
        first use and shared by every layer of the step. ``query``
        ``[num_decodes, num_heads, head_dim]``; ``key_cache`` as in :func:`paged_attention_layer`."""
        block_size = key_cache.shape[2]
        if block_size not in self._plans:
            self._plans[block_size] = inflight_kernels.decode_plan(query, key_cache, self.decode_block_tables,
                                                                   self.decode_context_lens)
        return self._plans[block_size]


def paged_attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Cache this step's K/V, then attend.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        sliding_window: each query sees its last N keys (itself included); None = all.
        logits_soft_cap: ``c * tanh(x / c)`` of the scaled scores; None = off.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    mask = _Mask(sliding_window or None, logits_soft_cap or None)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], key_cache, value_cache, span, scale, mask)
    if meta.decode_context_lens.numel():
        p = meta.num_prefill_tokens
        plan = False if mask.active else meta.decode_plan(q[p:], key_cache)
        inflight_kernels.decode_attention(q[p:], key_cache, value_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, scale, out=out[p:], plan=plan,
                                          sliding_window=mask.window, logits_soft_cap=mask.soft_cap)
    return out


@dataclass(frozen=True)
class _Mask:
    """A layer's sliding window and score soft-cap (None = off)."""

    window: int | None = None
    soft_cap: float | None = None

    @property
    def active(self) -> bool:
        """True when either is set (then no SDPA, no varlen or low-precision decode path)."""
        return self.window is not None or self.soft_cap is not None


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the
    caches ``[num_blocks, num_kv_heads, block_size, head_dim]`` at
    ``slot_mapping`` ``[num_tokens]`` int64 (negative = skip); see
    :func:`inflight_kernels.reshape_and_cache`."""
    inflight_kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _prefill_attention(q, k, v, key_cache, value_cache, span: PrefillSpan, scale: float,
                       mask: _Mask = _Mask()) -> torch.Tensor:
    """Causal attention of a chunk; with cached context (chunked prefill,
    prefix-cache hit, resume after preemption) keys come from the pages and
    query ``i`` sees positions ``<= start_pos + i``.

    With a cache dtype other than the compute dtype (a float16 cache under
    float32 compute), the chunk's own k/v are rounded to the cache dtype
    first, so a prefill attends over the values decode reads from the pages
    (the compiled decode kernel keeps a float32 q and output): a token's
    logits then do not depend on whether it was prefilled or decoded, and a
    continuation's or a preempted sequence's re-prefill continues the same
    greedy text.

    Where the compiled CPU decode kernel takes these shapes
    (:func:`inflight_kernels.prefill_as_decode`), every row goes through it instead, as
    a decode of context ``start_pos + i + 1`` over the pages (this step's K/V
    are written first, :func:`paged_attention_layer`): the kernel computes
    each (row, kv head) alone on one thread, so a row's output depends on its
    query and the cached K/V only, not on how many rows share the chunk.
    SDPA's does not (its softmax reductions run over the chunk's key span):
    a prefix-cache hit recomputing the last 3 of 51 prompt tokens moved a
    bfloat16 layer-8 attention output by one ulp and flipped the first greedy
    token of the same request (issue 24 item 5). Prefill then matches decode
    bit for bit, and a prompt's logits do not depend on prefix-cache hits or
    on where chunked prefill cut it.

    A sliding window or soft-cap (``mask``) on the other backends takes
    :func:`_masked_prefill`, explicit float32 scores (SDPA has no soft-cap)."""
    n = q.shape[0]
    by_decode = inflight_kernels.prefill_as_decode(q, key_cache, value_cache, span.block_table, span.start_pos,
                                                   scale, mask.window, mask.soft_cap)
    if by_decode is not None:
        return by_decode
    if key_cache.dtype != q.dtype:
        k, v = (t.to(key_cache.dtype).to(q.dtype) for t in (k, v))
    if mask.active:
        total = span.start_pos + n
        keys = k if span.start_pos == 0 else _gather_context(key_cache, span.block_table, total)
        values = v if span.start_pos == 0 else _gather_context(value_cache, span.block_table, total)
        return _masked_prefill(q, keys.to(q.dtype), values.to(q.dtype), span.start_pos, scale, mask)
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


def _masked_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int, scale: float,
                    mask: _Mask) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, H, D]`` (positions ``start_pos ..``) over
    ``keys``/``values`` ``[start_pos + n, KVH, D]`` with the window and soft-cap of
    ``mask`` (HF eager attention's order: scale, soft-cap, mask, float32 softmax);
    scores and softmax in float32, the result in ``q.dtype``."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [T, H, D]
    scores = torch.einsum("nhd,thd->hnt", q.float(), k) * scale
    if mask.soft_cap:
        scores = torch.tanh(scores / mask.soft_cap) * mask.soft_cap
    query_pos = torch.arange(start_pos, start_pos + n, device=q.device)[:, None]
    key_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    hidden = key_pos > query_pos
    if mask.window:
        hidden |= key_pos <= query_pos - mask.window
    probs = torch.softmax(scores.masked_fill_(hidden[None], float("-inf")), dim=-1)
    out = torch.einsum("hnt,thd->nhd", probs, values.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, num_kv_heads, head_dim]`` of one sequence, read from its pages."""
    block_size = cache.shape[2]
    pages = cache[block_table[: -(-length // block_size)]]  # [B, KVH, bs, D]
    return pages.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:length]
