"""Attention over the paged KV cache for one layer: prefill with torch SDPA,
decode through ``inflight_kernels.paged_attention`` wherever ``kernels`` has a compiled
kernel for the shapes (:func:`inflight_kernels.attention_backend`: CUDA, or the
compiled CPU kernel); elsewhere the torch paths: ``inflight_kernels.paged_attention``
(its torch reference; float32, even lengths), a padded cache-dtype path
(bf16/fp16, even lengths) or the padding-free path of
:mod:`worker.model.varlen_attention` (mixed lengths). K/V written with
``inflight_kernels.reshape_and_cache``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import inflight_kernels
from worker.model.varlen_attention import VarlenPlan, build_varlen_plan, varlen_decode_attention


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
        """The varlen plan of the decode rows, built on first use and shared by
        every layer of the step; False when ``kernels`` runs a compiled
        kernel for these shapes (:func:`inflight_kernels.attention_backend`: CUDA, or
        the compiled CPU kernel), or when
        :func:`use_varlen` chooses the padded path. ``query``
        ``[num_decodes, num_heads, head_dim]``; ``key_cache`` as in
        :func:`paged_attention_layer`."""
        block_size = key_cache.shape[2]
        if block_size not in self._plans:
            lens, tables = self.decode_context_lens, self.decode_block_tables
            chosen = inflight_kernels.attention_backend(query, key_cache) == "reference" and use_varlen(lens, block_size)
            self._plans[block_size] = (build_varlen_plan(tables, lens, block_size, VARLEN_CHUNK_BLOCKS)
                                       if chosen else False)
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
        decode_attention(q[p:], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
                         scale, out=out[p:], plan=plan, sliding_window=mask.window, logits_soft_cap=mask.soft_cap)
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


# Rule for the CPU decode path, from bench/decode_attention.py (see decode_attention).
VARLEN_MIN_WASTE = 1.3
VARLEN_CHUNK_BLOCKS = 1


def use_varlen(context_lens: torch.Tensor, block_size: int) -> bool:
    """True when the padding-free path is the default for these lengths:
    ``S * max_len / Σ ctx >= VARLEN_MIN_WASTE`` (padded tokens over tokens
    attended; lengths rounded up to whole blocks). ``context_lens``: ``[S]`` int."""
    if not context_lens.numel():
        return False
    blocks = (context_lens.long() + block_size - 1) // block_size
    used = int(blocks.sum())
    return used > 0 and context_lens.numel() * int(blocks.max()) >= VARLEN_MIN_WASTE * used


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, plan: VarlenPlan | bool | None = None,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Decode attention, same contract as :func:`inflight_kernels.paged_attention`.

    A sliding window or soft-cap (Mistral, Gemma 2/3) always goes to
    ``inflight_kernels.paged_attention``, which takes both (compiled CPU kernel or the
    torch reference); the varlen and low-precision torch paths below do not.

    ``inflight_kernels.paged_attention`` wherever it runs a compiled kernel
    (:func:`inflight_kernels.attention_backend` is "cuda" or "cpu"; on the CPU float32
    scores and softmax, no padding; faster than the torch paths below at
    SmolLM2-135M shapes, ``bench/decode_attention.py``, bench/RESULTS.md, "Measurements first recorded in docstrings").
    A float32 query over a bfloat16 cache (``--quantization q8_0``'s default
    cache on a CPU with AVX-512 BF16) is rounded to bfloat16 first, the
    precision the cache holds K and V in, so the CPU kernel's ``vdpbf16ps``
    path runs (:func:`inflight_kernels.cpu_bf16_dot`); the output is widened back.
    Otherwise (the "reference" backend) the path depends on how uneven the
    context lengths are (:func:`use_varlen`):

    * padding waste ``S * max_len / Σ ctx`` below ``VARLEN_MIN_WASTE``: the
      padded paths, ``inflight_kernels.paged_attention`` for float32 caches (the
      reference numerics) and :func:`_decode_attention_lowp` for bf16/fp16
      (no float32 cast of the pages; faster in bf16, bench/RESULTS.md, "Measurements first recorded in docstrings");
    * otherwise :func:`worker.model.varlen_attention.varlen_decode_attention`,
      whose work is proportional to Σ ctx, not ``S * max_len``.

    Measured (``bench/decode_attention.py``, bf16 cache, SmolLM2-135M shapes,
    one layer, medians of 41 alternating runs, 2 cores, AMD EPYC with
    AVX-512 BF16; padded ms -> varlen ms, speed-up):

    ===  ================  =====  ==================  =====
    S    lengths           waste  padded -> varlen    x
    ===  ================  =====  ==================  =====
    8    all 512           1.0    0.57 -> 0.75        0.75
    32   all 512           1.0    3.67 -> 3.72        0.99
    64   all 512           1.0    6.12 -> 5.86        1.04
    8    random 16..1024   2.96   1.37 -> 0.78        1.76
    32   random 16..1024   2.33   8.69 -> 4.17        2.08
    64   random 16..1024   2.02   14.2 -> 6.55        2.17
    8    1000 + 7 x 40     6.3    1.42 -> 0.58        2.45
    32   1000 + 31 x 40    14.4   5.83 -> 1.00        5.86
    64   1000 + 63 x 40    18.3   11.4 -> 1.44        7.92
    ===  ================  =====  ==================  =====

    With even lengths varlen is at best even (its many small per-block
    matmuls cost about what padding saves), and 25% slower at S=8, hence the
    threshold 1.3 ~ 1 / 0.75. The plan costs 0.2-0.4 ms once per step.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int32; context_lens: ``[num_seqs]`` int32.
        out: ``[num_seqs, num_heads, head_dim]`` output buffer, filled and returned.
        plan: None = choose here (building the plan if varlen is chosen);
            False = the padded path; a :class:`VarlenPlan` of this batch = the
            varlen path with it (built once per step, see
            :meth:`AttentionMetadata.decode_plan`).
    """
    backend = inflight_kernels.attention_backend(query, key_cache)
    masked = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    if (backend == "cpu" and query.dtype == torch.float32 and key_cache.dtype == torch.bfloat16
            and inflight_kernels.cpu_bf16_dot()):
        rounded = query.to(torch.bfloat16)  # to the cache's precision: the vdpbf16ps path
        out.copy_(inflight_kernels.paged_attention(rounded, key_cache, value_cache, block_tables, context_lens, scale,
                                          out=torch.empty_like(rounded), **masked))
        return out
    if backend != "reference" or sliding_window or logits_soft_cap:  # compiled (CUDA, CPU), or masked
        return inflight_kernels.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out=out,
                                       **masked)
    if plan is None and use_varlen(context_lens, key_cache.shape[2]):
        plan = build_varlen_plan(block_tables, context_lens, key_cache.shape[2], VARLEN_CHUNK_BLOCKS)
    if isinstance(plan, VarlenPlan):
        return varlen_decode_attention(query, key_cache, value_cache, plan, scale, out)
    if key_cache.dtype == torch.float32:
        return inflight_kernels.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out=out)
    return _decode_attention_lowp(query, key_cache, value_cache, block_tables, context_lens, scale, out)


def _decode_attention_lowp(query, key_cache, value_cache, block_tables, context_lens, scale, out) -> torch.Tensor:
    """Paged decode attention with the pages gathered once in the cache dtype.

    Numerics of HF ``LlamaAttention`` eager in bf16/fp16: ``q K^T`` and
    ``P V`` are matmuls in the cache dtype (float32 accumulation inside the
    kernel, result rounded to the cache dtype); scale, mask and softmax in
    float32, probabilities rounded to the cache dtype before ``P V``. Rows
    with context 0 yield zeros. Shapes as in :func:`decode_attention`.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    used_blocks = max(1, -(-int(context_lens.max()) // block_size))
    tables = block_tables[:, :used_blocks].long()
    keys = _gather_pages_native(key_cache, tables)  # [S, KVH, L, D] cache dtype
    values = _gather_pages_native(value_cache, tables)
    q = query.to(key_cache.dtype).view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [S, KVH, G, L] float32
    beyond = torch.arange(keys.shape[2], device=query.device)[None, :] >= context_lens.long()[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(values.dtype)
    out.copy_(torch.matmul(probs, values).view(num_seqs, num_heads, head_dim))
    return out


def _gather_pages_native(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[S, KVH, blocks*block_size, D]`` copy of each sequence's pages
    (``tables`` ``[S, blocks]`` int64), in the cache dtype. ``index_select``
    of whole blocks from a 2-D view, then one transposing copy (faster than
    ``cache[tables]``: bench/RESULTS.md, "Measurements first recorded in docstrings")."""
    s, b = tables.shape
    _, kvh, bs, d = cache.shape
    pages = cache.view(cache.shape[0], -1).index_select(0, tables.reshape(-1)).view(s, b, kvh, bs, d)
    return pages.transpose(1, 2).reshape(s, kvh, b * bs, d)


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
    (:func:`inflight_kernels.attention_backend` says "cpu"), every row goes through it instead, as
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
    if inflight_kernels.attention_backend(q, key_cache) == "cpu":
        tables = span.block_table.to(torch.int32)[None].expand(n, -1).contiguous()
        lens = torch.arange(span.start_pos + 1, span.start_pos + n + 1, dtype=torch.int32, device=q.device)
        q = q.contiguous()
        return decode_attention(q, key_cache, value_cache, tables, lens, scale, out=torch.empty_like(q), plan=False,
                                sliding_window=mask.window, logits_soft_cap=mask.soft_cap)
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
