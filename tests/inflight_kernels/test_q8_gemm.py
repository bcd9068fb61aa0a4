"""The Q8_0 x Q8_0 linear layer (inflight_kernels/cpu/q8_gemm.cpp) against its oracle
(inflight_kernels.reference.q8_0_linear), and the oracle's rounding. Like
test_cpu_kernels.py, these fail when the kernels do not build; only
INFLIGHT_CPU_KERNELS=0 skips."""

import os

import pytest
import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_oracle_rounds_each_block_within_half_a_step():
    x = _rand(3, 64) * torch.tensor([1.0] * 32 + [100.0] * 32)  # the second block 100x larger
    rounded = reference.q8_0_round(x)
    step = x.reshape(3, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert ((rounded - x).reshape(3, 2, 32).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(reference.q8_0_round(rounded), rounded)  # already on the grid
    with pytest.raises(ValueError, match="multiple of 32"):
        reference.q8_0_round(torch.zeros(2, 48))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 70])
@pytest.mark.parametrize("out_features,in_features", [(8, 32), (13, 64), (960, 576)])
def test_q8_linear_matches_the_oracle(rows, out_features, in_features):
    x, w = _rand(rows, in_features), _rand(out_features, in_features, seed=1, scale=0.05)
    packed, scales = cpu_ops.q8_pack_weight(w)
    assert packed.dtype == torch.int8 and packed.shape == (-(-out_features // 8), in_features // 32, 288)
    got = cpu_ops.q8_linear(x, packed, scales, out_features)
    want = reference.q8_0_linear(x, w)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_q8_linear_reads_strided_rows_and_other_dtypes():
    wide = _rand(5, 128)
    x = wide[:, :64]  # rows 128 apart
    w = _rand(16, 64, seed=2)
    packed, scales = cpu_ops.q8_pack_weight(w)
    want = reference.q8_0_linear(x, w)
    torch.testing.assert_close(cpu_ops.q8_linear(x, packed, scales, 16), want, rtol=1e-5, atol=1e-4)
    half = cpu_ops.q8_linear(x.bfloat16(), packed, scales, 16)  # cast to float32 first
    torch.testing.assert_close(half, reference.q8_0_linear(x.bfloat16().float(), w), rtol=1e-5, atol=1e-4)


def test_padding_columns_and_zero_blocks_are_zero():
    w = torch.zeros(3, 64)
    w[1, :32] = 1.0
    packed, scales = cpu_ops.q8_pack_weight(w)
    assert scales[0, 0, 1] == pytest.approx(1 / 127) and scales[0, 0, 3:].abs().max() == 0  # padded columns 3..7
    out = cpu_ops.q8_linear(torch.ones(2, 64), packed, scales, 3)
    assert torch.allclose(out, torch.tensor([[0.0, 32.0, 0.0]] * 2))


def test_bad_shapes_raise():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.q8_pack_weight(torch.zeros(8, 40))
    packed, scales = cpu_ops.q8_pack_weight(torch.zeros(8, 64))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_ops.q8_linear(torch.zeros(2, 32), packed, scales, 8)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_ops.q8_linear(torch.zeros(2, 64), packed, scales, 16)


def _int8_rows(packed):
    """The int8 weight rows ``[tiles * 8, blocks * 32]`` of a packed Q8_0 weight: tile t, block b,
    register j, column c, byte i hold row 8t + c, input 32b + 4j + i; bytes 256.. the compensations."""
    tiles, blocks, _ = packed.shape
    return packed[..., :256].reshape(tiles, blocks, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(tiles * 8, blocks * 32)


def _unpack(packed, scales, out_features):
    """The float weight a packed Q8_0 one stands for."""
    tiles, blocks, _ = packed.shape
    q = _int8_rows(packed)
    d = scales.permute(0, 2, 1).reshape(tiles * 8, blocks).repeat_interleave(32, dim=1)
    return (q.float() * d)[:out_features]


def test_packed_weight_is_exactly_the_oracles_rounding():
    w = _rand(21, 96, seed=4) * torch.linspace(0.01, 10, 96)  # blocks of very different ranges
    packed, scales = cpu_ops.q8_pack_weight(w)
    assert torch.equal(_unpack(packed, scales, 21), reference.q8_0_round(w))


def test_no_rows_and_zero_rows():
    packed, scales = cpu_ops.q8_pack_weight(_rand(16, 64))
    assert cpu_ops.q8_linear(torch.zeros(0, 64), packed, scales, 16).shape == (0, 16)  # a step without logits rows
    x = _rand(3, 64)
    x[1] = 0.0
    assert torch.equal(cpu_ops.q8_linear(x, packed, scales, 16)[1], torch.zeros(16))


def test_each_block_carries_its_columns_compensation():
    """Bytes 256..288 of a (tile, block): int32 -128 * sum of the column's int8 weights, the term
    the VNNI kernel's unsigned activations (q + 128) add; padding columns 0."""
    w = _rand(13, 64, seed=5)
    packed, _ = cpu_ops.q8_pack_weight(w)
    want = -128 * _int8_rows(packed).view(16, 2, 32).int().sum(-1)  # [16 columns, 2 blocks]
    got = packed[..., 256:].contiguous().view(torch.int32)  # [2 tiles, 2 blocks, 8]
    assert torch.equal(got.permute(0, 2, 1).reshape(16, 2), want)
    assert torch.equal(want[13:], torch.zeros(3, 2, dtype=torch.int32))
