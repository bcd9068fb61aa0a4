"""The torch reference kernels against a naive per-sequence implementation."""

from __future__ import annotations

import pytest
import torch

import inflight_kernels
from inflight_kernels import reference


def _naive_attention(query, keys, values, scale):
    """One sequence: query [H, D], keys/values [L, KVH, D] -> [H, D]."""
    group = query.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    probs = torch.softmax((query[:, None, :] @ k.transpose(1, 2)) * scale, dim=-1)
    return (probs @ v)[:, 0, :]


def _random_layout(gen, context_lens, block_size, num_blocks):
    """Disjoint random block tables, padded with 0 to the same width."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in context_lens:
        count = -(-n // block_size)
        tables.append(perm[used : used + count])
        used += count
    width = max(len(t) for t in tables) + 1
    return [t + [0] * (width - len(t)) for t in tables]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cache_write_then_paged_attention_matches_naive(group, block_size):
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    num_kv_heads, head_dim, num_blocks = 2, 16, 64
    context_lens = [1, 5, block_size, block_size + 3, 3 * block_size - 1]
    tables = _random_layout(gen, context_lens, block_size, num_blocks)
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    value_cache = torch.randn_like(key_cache)
    seq_keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in context_lens]
    seq_values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in context_lens]
    slots = [tables[s][p // block_size] * block_size + p % block_size for s, n in enumerate(context_lens) for p in range(n)]
    slots_with_padding = torch.tensor(slots + [-1, -1], dtype=torch.int64)
    junk = torch.full((2, num_kv_heads, head_dim), 1e4)
    inflight_kernels.reshape_and_cache(
        torch.cat([*seq_keys, junk]), torch.cat([*seq_values, junk]), key_cache, value_cache, slots_with_padding
    )
    assert key_cache.abs().max() < 1e3  # padding rows were skipped

    query = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = inflight_kernels.paged_attention(
        query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32), scale,
    )
    for s in range(len(context_lens)):
        expected = _naive_attention(query[s], seq_keys[s], seq_values[s], scale)
        torch.testing.assert_close(out[s], expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_writes_into_out_and_keeps_dtype():
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(4, 1, 8, 8, generator=gen).bfloat16()
    value_cache = torch.randn(4, 1, 8, 8, generator=gen).bfloat16()
    query = torch.randn(2, 2, 8, generator=gen).bfloat16()
    out = torch.empty_like(query)
    result = reference.paged_attention(
        query, key_cache, value_cache, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        torch.tensor([9, 8], dtype=torch.int32), 0.3, out=out,
    )
    assert result is out and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_bad_shapes_raise_value_error():
    cache = torch.zeros(4, 2, 8, 16)
    with pytest.raises(ValueError, match="GQA"):
        reference.paged_attention(torch.zeros(1, 3, 16), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.reshape_and_cache(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), cache, cache,
                                    torch.zeros(2, dtype=torch.int64))
