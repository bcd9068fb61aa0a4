"""Padding-free ("varlen") paged decode attention for the CPU.

The padded path (:func:`inflight_kernels.paged_decode.padded_lowp_decode_attention`,
:func:`inflight_kernels.reference.paged_attention`) gathers ``[S, KVH, max_len, D]``
pages, so with continuous batching (contexts of very different lengths in one
batch) most of the gathered K/V and of the score work is padding. Here the
work is proportional to the sum of the context lengths: the batch is cut into
(sequence, chunk) *pairs*, a chunk being ``chunk_blocks`` consecutive cache
blocks of one sequence, and only the chunks a sequence actually uses are
gathered (``Σ_s ceil(ctx_s / chunk_tokens)`` pairs). Each pair gets a partial
softmax (its own max, sum and un-normalised ``P V``), and the partials of a
sequence are merged with the usual rescaling by ``exp(m_pair - m_seq)``.

Ideas from vLLM PagedAttention (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP 2023: attention read
block by block through a block table, partitions merged by max/sum
rescaling) and FlashAttention's variable-length batches (Dao et al.,
"FlashAttention", NeurIPS 2022; ``flash_attn_varlen``: sequences packed
without padding, addressed by cumulative offsets). The code is our own, in
plain torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VarlenPlan:
    """Which cache blocks a decode batch reads, shared by every layer of a step.

    Attributes:
        num_seqs: S, rows of the batch.
        chunk_blocks: cache blocks per pair (chunk of ``chunk_blocks * block_size`` tokens).
        seq_of_pair: ``[P]`` int64, the sequence of each pair (non-decreasing).
        block_ids: ``[P * chunk_blocks]`` int64 physical block of each chunk
            slot (slots past a sequence's last block point at block 0 and are masked).
        beyond: ``[P, chunk_tokens]`` bool, True where the position is at or
            past the sequence's context length (masked out).
    """

    num_seqs: int
    chunk_blocks: int
    seq_of_pair: torch.Tensor
    block_ids: torch.Tensor
    beyond: torch.Tensor

    @property
    def num_pairs(self) -> int:
        """P, the number of (sequence, chunk) pairs."""
        return int(self.seq_of_pair.shape[0])


def build_varlen_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                      chunk_blocks: int = 1) -> VarlenPlan:
    """List the (sequence, chunk) pairs a decode batch uses.

    Args:
        block_tables: ``[S, max_blocks]`` int32/int64 block ids (entries past a
            sequence's last block are never read).
        context_lens: ``[S]`` int32, tokens attended (0 = no pair, output zeros).
        block_size: tokens per cache block.
        chunk_blocks: blocks per pair (>= 1).

    Returns:
        A :class:`VarlenPlan` on ``context_lens``' device.

    Raises:
        ValueError: ``chunk_blocks < 1`` or mismatched shapes.
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    if block_tables.dim() != 2 or context_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} mismatch")
    dev = context_lens.device
    lens = context_lens.long()
    chunk_tokens = chunk_blocks * block_size
    chunks = (lens + chunk_tokens - 1) // chunk_tokens  # [S]
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=dev), chunks)  # [P]
    first = torch.cumsum(chunks, 0) - chunks
    chunk = torch.arange(seq.shape[0], device=dev) - first[seq]  # [P] chunk index inside its sequence
    cols = chunk[:, None] * chunk_blocks + torch.arange(chunk_blocks, device=dev)  # [P, chunk_blocks]
    used = cols < ((lens + block_size - 1) // block_size)[seq][:, None]
    tables = block_tables.to(dev).long()
    ids = tables[seq[:, None], cols.clamp(max=max(tables.shape[1] - 1, 0))] if tables.shape[1] else cols * 0
    ids = torch.where(used, ids, torch.zeros((), dtype=torch.long, device=dev))
    pos = chunk[:, None] * chunk_tokens + torch.arange(chunk_tokens, device=dev)
    return VarlenPlan(int(lens.shape[0]), chunk_blocks, seq, ids.reshape(-1), pos >= lens[seq][:, None])


def varlen_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            plan: VarlenPlan, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Decode attention over only the blocks each sequence uses.

    Numerics follow :func:`inflight_kernels.paged_decode.padded_lowp_decode_attention`:
    ``q K^T`` and ``P V`` are matmuls in the cache dtype (float32
    accumulation inside the kernel), scale, mask, exp and the merge of the
    partials in float32, un-normalised probabilities (in ``[0, 1]``) rounded to
    the cache dtype before ``P V``. With a float32 cache everything is
    float32 (equal to :func:`inflight_kernels.reference.paged_attention` up to
    summation order). Rows with context 0 yield zeros.

    Args:
        query: ``[S, num_heads, head_dim]``, any float dtype (cast to the cache dtype).
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        plan: from :func:`build_varlen_plan` for this batch (``plan.num_seqs == S``).
        scale: softmax scale.
        out: ``[S, num_heads, head_dim]`` buffer, filled and returned.

    Raises:
        ValueError: ``plan`` built for another batch size.
    """
    num_seqs, num_heads, head_dim = query.shape
    if plan.num_seqs != num_seqs:
        raise ValueError(f"plan is for {plan.num_seqs} sequences, query has {num_seqs}")
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    pairs = plan.num_pairs
    if pairs == 0:
        return out.zero_()
    seq = plan.seq_of_pair
    keys = _gather_chunks(key_cache, plan.block_ids, pairs, plan.chunk_blocks)  # [P, KVH, C, D]
    values = _gather_chunks(value_cache, plan.block_ids, pairs, plan.chunk_blocks)
    q = query.to(key_cache.dtype).view(num_seqs, num_kv_heads, group, head_dim).index_select(0, seq)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [P, KVH, G, C] float32
    scores.masked_fill_(plan.beyond[:, None, None, :], float("-inf"))
    pair_max = scores.amax(-1)  # [P, KVH, G]; finite: every pair holds >= 1 position in context
    probs = scores.sub_(pair_max[..., None]).exp_()
    pair_sum = probs.sum(-1)  # [P, KVH, G]
    pair_out = torch.matmul(probs.to(values.dtype), values).float()  # [P, KVH, G, D]
    seq_max = torch.full((num_seqs, num_kv_heads, group), float("-inf"), device=query.device)
    seq_max.scatter_reduce_(0, seq[:, None, None].expand_as(pair_max), pair_max, "amax")
    weight = (pair_max - seq_max.index_select(0, seq)).exp_()  # [P, KVH, G] in (0, 1]
    num = torch.zeros(num_seqs, num_kv_heads, group, head_dim, device=query.device)
    num.index_add_(0, seq, pair_out.mul_(weight[..., None]))
    den = torch.zeros(num_seqs, num_kv_heads, group, device=query.device).index_add_(0, seq, pair_sum.mul_(weight))
    out.copy_(num.div_(den.clamp_min_(1e-30)[..., None]).view(num_seqs, num_heads, head_dim))
    return out


def _gather_chunks(cache: torch.Tensor, block_ids: torch.Tensor, pairs: int, chunk_blocks: int) -> torch.Tensor:
    """``[P, KVH, chunk_blocks*block_size, D]`` copy (cache dtype) of each
    pair's blocks: one ``index_select`` of whole blocks on a 2-D view; with
    one block per pair the result is already in that layout (no second copy)."""
    _, kvh, bs, d = cache.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    if chunk_blocks == 1:
        return rows.view(pairs, kvh, bs, d)
    return rows.view(pairs, chunk_blocks, kvh, bs, d).transpose(1, 2).reshape(pairs, kvh, chunk_blocks * bs, d)
