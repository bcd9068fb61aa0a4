"""Torch reference of every kernel op: the fallback path of :mod:`inflight_kernels.dispatch`
and the test oracle. Paged KV-cache ops, the decoder's element-wise layer ops
(RMSNorm, RoPE, SwiGLU; the model's torch path, ``worker/model/layers.py``, uses
these) and the Q8_0 rounding.

Layout (docs/CONTRACTS.md): per layer ``key_cache``/``value_cache`` are
``[num_blocks, num_kv_heads, block_size, head_dim]``; the slot of a token is
``block_id * block_size + offset``. Paged attention as introduced by vLLM
(Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023); grouped-query attention (GQA) as in Ainslie
et al. 2023: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value into its cache slot, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype
            (cast to the cache dtype).
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64; slot = block_id * block_size +
            offset; negative entries are padding and are skipped.

    Raises:
        ValueError: mismatched shapes.
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[valid].to(value_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its cached context.

    ``out[s, h] = softmax(cap(scale * q[s, h] . K[s, lo:ctx]^T)) V[s, lo:ctx]`` where
    K/V of sequence ``s`` are gathered from the pages listed in
    ``block_tables[s]``, ``ctx = context_lens[s]`` and ``lo = max(0, ctx -
    sliding_window)`` (the query, at position ``ctx - 1``, sees the last
    ``sliding_window`` keys: HF's ``kv_idx > q_idx - sliding_window``, Mistral and
    Gemma 2/3's local layers); ``cap(x) = c * tanh(x / c)`` with ``c =
    logits_soft_cap`` (Gemma 2's ``attn_logit_softcapping``), the identity when None.
    Pages wholly before ``lo`` are not read (their table entries may be stale).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 (unused entries 0).
        context_lens: ``[num_seqs]`` int32, tokens attended including the
            current one (>= 1; a row with 0 yields zeros).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_seqs, num_heads, head_dim]`` output buffer.
        sliding_window: keys attended per query (None or 0 = all).
        logits_soft_cap: tanh soft-cap of the scaled scores (None or 0 = off).

    Returns:
        ``out`` (or a new tensor) like ``query``. Scores and softmax are
        computed in float32.

    Raises:
        ValueError: mismatched shapes or num_heads not a multiple of num_kv_heads.
    """
    check_attention(query, key_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max()) if num_seqs else 0
    used_blocks = max(1, -(-max_len // block_size))
    lens = context_lens.to(query.device).long()
    tables = block_tables[:, :used_blocks].long()
    if sliding_window:  # pages wholly before the window may be freed: read block 0 there, masked below
        first = ((lens - sliding_window).clamp(min=0) // block_size)[:, None]
        tables = torch.where(torch.arange(used_blocks, device=tables.device)[None, :] < first.to(tables.device),
                             torch.zeros_like(tables), tables)
    keys = _gather_pages(key_cache, tables)  # [S, KVH, L, D]
    values = _gather_pages(value_cache, tables)
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [S, KVH, G, L]
    if logits_soft_cap:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    positions = torch.arange(keys.shape[2], device=query.device)
    beyond = positions[None, :] >= lens[:, None]  # [S, L]
    if sliding_window:
        beyond |= positions[None, :] < (lens - sliding_window)[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    result = torch.matmul(probs, values).view(num_seqs, num_heads, head_dim)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def _gather_pages(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[S, KVH, blocks*block_size, D]`` float32 copy of each sequence's pages
    (``tables`` ``[S, blocks]`` int64): whole blocks picked with
    ``index_select`` on a 2-D view (same values as ``cache[tables]``, fewer
    index computations), then one transposing copy."""
    s, b = tables.shape
    _, kvh, bs, d = cache.shape
    rows = cache.reshape(cache.shape[0], -1).index_select(0, tables.reshape(-1))
    return rows.view(s, b, kvh, bs, d).permute(0, 2, 1, 3, 4).reshape(s, kvh, b * bs, d).float()


def check_cache_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Raise ValueError unless the shapes follow :func:`reshape_and_cache`'s contract."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} / {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must be [num_blocks, num_kv_heads, block_size, head_dim], got {tuple(key_cache.shape)} / {tuple(value_cache.shape)}")
    if key.shape[1] != key_cache.shape[1] or key.shape[2] != key_cache.shape[3]:
        raise ValueError(f"key {tuple(key.shape)} does not fit cache {tuple(key_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")


def check_attention(query, key_cache, block_tables, context_lens) -> None:
    """Raise ValueError unless the shapes follow :func:`paged_attention`'s contract."""
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"query must be 3-D and key_cache 4-D, got {tuple(query.shape)} / {tuple(key_cache.shape)}")
    if query.shape[1] % key_cache.shape[1] or query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} incompatible with cache {tuple(key_cache.shape)} (GQA needs num_heads % num_kv_heads == 0)")
    if block_tables.dim() != 2 or block_tables.shape[0] != query.shape[0] or context_lens.shape != (query.shape[0],):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} do not match {query.shape[0]} sequences")


Q8_BLOCK = 32  # values per scale of a Q8_0 block (llama.cpp, ggml-quants.c)


def symmetric_round(x: torch.Tensor, bits: int, block: int | None) -> torch.Tensor:
    """``x`` ``[rows, cols]`` float32 rounded to symmetric ``bits``-bit levels
    ``±(2^(bits-1) - 1)``: per ``block`` values of a row (None = the whole row),
    ``d = max|v| / levels`` (at least 1e-12 / levels) and
    ``v -> clamp(round(v * (1 / d)), -levels, levels) * d`` (ggml's
    quantize_row_q8_0 multiplies by the reciprocal too); same shape, float32.

    Raises:
        ValueError: ``cols`` is not a multiple of ``block``.
    """
    levels = 2 ** (bits - 1) - 1
    rows, cols = x.shape
    width = cols if block is None else block
    if cols % width:
        raise ValueError(f"{cols} columns are not a multiple of {width}")
    blocks = x.float().reshape(rows, cols // width, width)
    d = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
    return (torch.round(blocks * (1.0 / d)).clamp(-levels, levels) * d).reshape(rows, cols)


def q8_0_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, cols]`` (cols a multiple of 32) rounded to Q8_0: 8 bits, one
    scale per 32 values (:func:`symmetric_round`). Raises ValueError otherwise."""
    return symmetric_round(x, 8, Q8_BLOCK)


def q8_0_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Oracle of the Q8_0 x Q8_0 linear layer (``inflight_kernels/cpu/q8_gemm.cpp``):
    ``q8_0_round(x) @ q8_0_round(weight).T`` for ``x`` ``[M, K]`` and ``weight``
    ``[N, K]``; returns ``[M, N]`` float32."""
    return q8_0_round(x) @ q8_0_round(weight).T


def q4_1_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, cols]`` (cols a multiple of 32) rounded to llama.cpp's Q4_1
    (ggml-quants.c quantize_row_q4_1_ref): per block of 32 values ``m = min``,
    ``d = (max - m) / 15``, ``q = min(15, floor((v - m) / d + 0.5))`` (0 where
    ``d`` is 0), then ``v -> q * fp16(d) + fp16(m)``; same shape, float32.

    Raises:
        ValueError: ``cols`` is not a multiple of 32."""
    rows, cols = x.shape
    if cols % Q8_BLOCK:
        raise ValueError(f"{cols} columns are not a multiple of {Q8_BLOCK}")
    blocks = x.float().reshape(rows, cols // Q8_BLOCK, Q8_BLOCK)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor((blocks - lo) * inv + 0.5).clamp(max=15)
    return (q * d.half().float() + lo.half().float()).reshape(rows, cols)


def q4_1_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Oracle of the Q4_1 x Q8_0 linear layer (``inflight_kernels/cpu/q4_gemm.cpp``):
    ``q8_0_round(x) @ q4_1_round(weight).T`` for ``x`` ``[M, K]`` and ``weight``
    ``[N, K]``; returns ``[M, N]`` float32."""
    return q8_0_round(x) @ q4_1_round(weight).T


def q4_1_dequant_linear(x: torch.Tensor, weight: torch.Tensor, bf16_activations: bool = False) -> torch.Tensor:
    """Oracle of the weight-only Q4_1 linear layer (``inflight_kernels/cpu/dequant_gemm.cpp``):
    ``x @ q4_1_round(weight).T`` in float64, returned as float32 ``[M, N]``, for ``x``
    ``[M, K]`` and ``weight`` ``[N, K]``: the activations are not rounded, or with
    ``bf16_activations`` rounded to bfloat16 (round to nearest even) first
    (``inflight_kernels/cpu/dequant_gemm_bf16.cpp``)."""
    if bf16_activations:
        x = x.bfloat16()
    return (x.double() @ q4_1_round(weight).double().T).float()


def q8_0_dequant_linear(x: torch.Tensor, weight: torch.Tensor, bf16_activations: bool = False) -> torch.Tensor:
    """Oracle of the weight-only Q8_0 linear layer (``inflight_kernels/cpu/dequant_gemm.cpp``):
    ``x @ q8_0_round(weight).T`` in float64, returned as float32 ``[M, N]``; with
    ``bf16_activations`` ``x`` is rounded to bfloat16 first (``inflight_kernels/cpu/dequant_gemm_bf16.cpp``)."""
    if bf16_activations:
        x = x.bfloat16()
    return (x.double() @ q8_0_round(weight).double().T).float()


def kquant_dequantize_rows(blocks: torch.Tensor, ggml_type: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """A K-quant tensor's rows (``ids``, all when None) dequantized with the ``gguf``
    package's numpy code (``gguf.quants.dequantize``, a port of ggml-quants.c): float32
    ``[len(ids), K]`` for ``blocks`` uint8 ``[N, K / 256 * block bytes]`` of ggml type id
    ``ggml_type``."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = blocks if ids is None else blocks[ids.reshape(-1).long()]
    values = dequantize(np.ascontiguousarray(rows.numpy()), GGMLQuantizationType(int(ggml_type)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows.shape[0], -1)


def kquant_linear(x: torch.Tensor, blocks: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """Oracle of the K-quant linear layer (``inflight_kernels/cpu/kquant_gemm.cpp``):
    ``x @ W.T`` in float64 over the weights dequantized by :func:`kquant_dequantize_rows`,
    returned as float32 ``[M, sum rows_i]``; the activations are not rounded."""
    weight = torch.cat([kquant_dequantize_rows(b, t) for b, t in zip(blocks, types)])
    return (x.double() @ weight.double().T).float()


def lora_apply(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, a_t: torch.Tensor,
               pieces: torch.Tensor, b_ts: list[torch.Tensor]) -> torch.Tensor:
    """Oracle of the batched LoRA product grouped by adapter (``inflight_kernels/cpu/lora_gemm.cpp``;
    the SGMV shape of Punica, Chen et al. 2023): for every row ``r`` of ``x`` ``[N, in]`` whose
    ``row_slots[r]`` (int64 ``[N]``) is not -1, and every piece ``p`` (a row of ``pieces``, int64
    ``[P, 5]``: slot, out_start, out_end, col_start, col_end) of that slot,
    ``out[r, out_start:out_end] += (x[r] @ a_t[:, col_start:col_end]) @ b_ts[p]``, with ``a_t``
    ``[in, R_total]`` and ``b_ts[p]`` ``[col_end - col_start, out_end - out_start]``; summed in
    float64. Base rows (-1) are left as they are. ``out`` ``[N, O]`` is updated in place and
    returned."""
    for p, (slot, o0, o1, c0, c1) in enumerate(pieces.tolist()):
        rows = (row_slots == slot).nonzero().flatten()
        if rows.numel():
            delta = (x[rows].double() @ a_t[:, c0:c1].double()) @ b_ts[p].double()
            out[rows, o0:o1] += delta.to(out.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as in HF ``LlamaRMSNorm``: statistics in
    float32, result cast back to ``x.dtype`` before the weight multiply.

    Args:
        x: ``[num_tokens, hidden]``, any float dtype (rows may be strided).
        weight: ``[hidden]``.

    Returns:
        A new ``[num_tokens, hidden]`` tensor, dtype ``torch.promote_types(x.dtype, weight.dtype)``.

    Raises:
        RuntimeError: shapes that do not broadcast (from torch).
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (rounded to ``residual``'s dtype), then
    :func:`rms_norm` of the sum, returned as a new tensor: the residual add
    folded into the next norm. ``residual``, ``delta`` ``[num_tokens, hidden]``,
    ``weight`` ``[hidden]``. Raises RuntimeError on shapes that do not broadcast."""
    residual += delta
    return rms_norm(residual, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings (Su et al. 2021) with HF's ``rotate_half`` convention
    (NeoX style: first half paired with second half).

    Args:
        x: ``[num_tokens, heads, head_dim]``.
        cos, sin: ``[num_tokens, head_dim]`` (HF layout: frequencies repeated
            for both halves), in ``x``'s dtype.

    Returns:
        A new tensor like ``x``.

    Raises:
        RuntimeError: shapes that do not broadcast (from torch).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """:func:`apply_rope` in place on the first ``heads`` heads of each row of
    ``qkv`` ``[num_tokens, >= heads * head_dim]`` (fused q, k, v rows: the q
    heads then the k heads; the rest, v, untouched); ``cos``/``sin``
    ``[num_tokens, head_dim]`` in qkv's dtype.

    Raises:
        RuntimeError: rows narrower than ``heads * head_dim`` or shapes that do not broadcast.
    """
    rows = qkv[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    rows.copy_(apply_rope(rows, cos, sin))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` from the fused gate/up
    projection ``[num_tokens, 2 * intermediate]``; returns a new
    ``[num_tokens, intermediate]`` tensor in ``gate_up``'s dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
