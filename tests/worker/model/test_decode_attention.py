"""inflight_kernels.decode_attention (inflight_kernels/paged_decode.py) and the varlen path against the
inflight_kernels.reference oracle (float32 scores and softmax). The compiled CPU kernel
has its own tests (tests/inflight_kernels/test_cpu_kernels.py); here the torch paths
that stand in for it where it cannot be built run with it switched off."""

import os

import pytest
import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops
from inflight_kernels.paged_decode import VARLEN_MIN_WASTE, decode_attention, use_varlen
from inflight_kernels.varlen_attention import build_varlen_plan, varlen_decode_attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def _case(dtype, lens, seed=0, heads=9, kv_heads=3, block_size=16, head_dim=64, num_blocks=None):
    """Random caches; each sequence gets distinct blocks scattered over the cache,
    spare table entries hold other (valid) block ids."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    max_blocks = max(1, -(-int(lens.max()) // block_size)) + 1
    num_blocks = num_blocks or len(lens) * max_blocks + 3
    key_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    query = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return query, key_cache, value_cache, tables.to(torch.int32), lens


@pytest.fixture
def torch_paths(monkeypatch):
    """decode_attention as on a machine without the compiled CPU kernel."""
    monkeypatch.setattr(cpu_ops, "available", lambda: False)


def _check(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype]), (out.float() - ref).abs().max()


def test_float32_uniform_lengths_is_the_reference_exactly(torch_paths):
    q, kc, vc, tables, lens = _case(torch.float32, [40, 33, 48, 48])
    assert not use_varlen(lens, 16)
    ref = reference.paged_attention(q, kc, vc, tables, lens, 0.125)
    assert torch.equal(decode_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q)), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_default_path_close_to_reference_mixed_lengths(dtype, compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    elif os.environ.get(cpu_build.ENV_SWITCH) == "0":
        pytest.skip("compiled CPU kernels switched off")
    q, kc, vc, tables, lens = _case(dtype, [1, 17, 96, 0, 50], seed=1)
    assert use_varlen(lens, 16)
    ref = reference.paged_attention(q, kc, vc, tables, lens, 0.125).float()
    out = decode_attention(q, kc, vc, tables, lens, 0.125, torch.full_like(q, float("nan")))
    _check(out, ref, dtype)
    assert torch.count_nonzero(out[3]) == 0  # context 0 -> zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_blocks", [1, 3])
@pytest.mark.parametrize("lens", [
    [1, 2, 15, 16, 17, 31, 32, 33, 200],  # block boundaries
    [1],
    [16],
    [129],  # a single sequence
    [1000, 3, 40, 40, 1, 40],  # one long + short ones
    [64, 64, 64],  # even lengths
])
def test_varlen_matches_reference(dtype, chunk_blocks, lens):
    q, kc, vc, tables, lens_t = _case(dtype, lens, seed=len(lens) + chunk_blocks)
    ref = reference.paged_attention(q, kc, vc, tables, lens_t, 0.125).float()
    plan = build_varlen_plan(tables, lens_t, 16, chunk_blocks)
    assert plan.num_pairs == sum(-(-n // (16 * chunk_blocks)) for n in lens)
    _check(varlen_decode_attention(q, kc, vc, plan, 0.125, torch.full_like(q, float("nan"))), ref, dtype)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 1), (12, 4)])
def test_varlen_gqa_groups_and_block_size(heads, kv_heads):
    q, kc, vc, tables, lens = _case(torch.bfloat16, [5, 8, 9, 24, 0, 1], seed=heads, heads=heads, kv_heads=kv_heads,
                                    block_size=8, head_dim=32)
    ref = reference.paged_attention(q, kc, vc, tables, lens, 32 ** -0.5).float()
    out = varlen_decode_attention(q, kc, vc, build_varlen_plan(tables, lens, 8), 32 ** -0.5, torch.empty_like(q))
    _check(out, ref, torch.bfloat16)
    assert torch.count_nonzero(out[4]) == 0


def test_varlen_reads_only_blocks_in_context():
    """Blocks outside every sequence's context (including the spare table
    entries) are never read: NaN there must not reach the output; stale
    finite values past the end of a last block are masked out (the cache is
    zero-initialised, so those slots are never NaN)."""
    q, kc, vc, tables, lens = _case(torch.float32, [3, 20, 16], seed=7)
    used = {int(tables[s, b]) for s, n in enumerate(lens.tolist()) for b in range(-(-n // 16))}
    for blk in range(kc.shape[0]):
        if blk not in used:
            kc[blk], vc[blk] = float("nan"), float("nan")
    for s, n in enumerate(lens.tolist()):  # slots past the end inside the last block
        blk, off = int(tables[s, (n - 1) // 16]), (n - 1) % 16 + 1
        kc[blk, :, off:], vc[blk, :, off:] = 1e4, -1e4
    out = varlen_decode_attention(q, kc, vc, build_varlen_plan(tables, lens, 16, 2), 0.125, torch.empty_like(q))
    ref = reference.paged_attention(q, kc.nan_to_num(0.0), vc.nan_to_num(0.0), tables, lens, 0.125)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_all_empty_and_plan_mismatch():
    q, kc, vc, tables, lens = _case(torch.bfloat16, [0, 0])
    plan = build_varlen_plan(tables, lens, 16)
    assert plan.num_pairs == 0
    assert torch.count_nonzero(varlen_decode_attention(q, kc, vc, plan, 0.125, torch.ones_like(q))) == 0
    with pytest.raises(ValueError):
        varlen_decode_attention(q[:1], kc, vc, plan, 0.125, torch.empty_like(q[:1]))
    with pytest.raises(ValueError):
        build_varlen_plan(tables, lens, 16, chunk_blocks=0)


def test_use_varlen_rule():
    assert not use_varlen(torch.tensor([512] * 8, dtype=torch.int32), 16)
    assert not use_varlen(torch.tensor([], dtype=torch.int32), 16)
    assert not use_varlen(torch.tensor([0, 0], dtype=torch.int32), 16)
    assert use_varlen(torch.tensor([1000] + [40] * 7, dtype=torch.int32), 16)
    # 10 sequences, longest 10 blocks: padded 100 blocks; Σ blocks on either side of 100 / VARLEN_MIN_WASTE
    edge = 100 / VARLEN_MIN_WASTE
    below = [160] + [16 * 10] * 9  # Σ 100 blocks, waste 1.0
    above = [160] + [16] * 9  # Σ 19 blocks
    assert sum(-(-n // 16) for n in above) <= edge < sum(-(-n // 16) for n in below)
    assert not use_varlen(torch.tensor(below, dtype=torch.int32), 16)
    assert use_varlen(torch.tensor(above, dtype=torch.int32), 16)
    # lengths rounded up to blocks: 17 tokens = 2 blocks
    assert not use_varlen(torch.tensor([32, 17], dtype=torch.int32), 16)


def test_cpu_uses_the_compiled_kernel_when_built():
    if os.environ.get(cpu_build.ENV_SWITCH) == "0":
        pytest.skip("compiled CPU kernels switched off (INFLIGHT_CPU_KERNELS=0)")
    assert cpu_ops.available(), "the CPU kernels did not build; see the warning logged by inflight_kernels.cpu.build"
    q, kc, vc, tables, lens = _case(torch.bfloat16, [1, 17, 300, 64], seed=3)
    expected = cpu_ops.paged_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q))
    assert torch.equal(decode_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q)), expected)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_plan_is_varlen_exactly_when_the_compiled_kernel_cannot_take_the_shapes(head_dim):
    """Uneven lengths: varlen pays off unless the compiled kernel runs these shapes
    (it has no head_dim 16 build, so there the plan must not fall back to padding)."""
    from worker.model.attention import AttentionMetadata
    from inflight_kernels.varlen_attention import VarlenPlan

    lens = torch.tensor([1000] + [40] * 7, dtype=torch.int32)
    key_cache = torch.zeros(8 * 63, 3, 16, head_dim, dtype=torch.bfloat16)
    query = torch.zeros(8, 9, head_dim, dtype=torch.bfloat16)
    tables = torch.arange(8 * 63, dtype=torch.int32).view(8, 63)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), (), 0, tables, lens)
    plan = meta.decode_plan(query, key_cache)
    assert use_varlen(lens, 16)
    assert isinstance(plan, VarlenPlan) == (not cpu_ops.supports(query, key_cache))
    assert meta.decode_plan(query, key_cache) is plan  # built once per step
    if head_dim == 16:
        assert isinstance(plan, VarlenPlan)
