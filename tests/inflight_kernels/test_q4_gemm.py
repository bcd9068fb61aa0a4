"""The Q4_1 x Q8_0 linear layer (inflight_kernels/cpu/q4_gemm.cpp) against its oracle
(inflight_kernels.reference.q4_1_linear), the oracle's rounding, and the packed blocks
against the default GGUF's own Q4_1 blocks. Like test_cpu_kernels.py, these fail
when the kernels do not build; only INFLIGHT_CPU_KERNELS=0 skips."""

import os

import numpy as np
import pytest
import torch

from common.model_files import default_model_path
from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float weight a packed Q4_1 one stands for: tile t, block b, register j, column c,
    byte i hold row 8t + c, inputs 32b + 8j + i (low nibble) and 32b + 8j + 4 + i (high);
    bytes 128..144 the columns' fp16 d, 144..160 their fp16 m."""
    tiles, blocks, _ = packed.shape
    nibbles = packed[..., :128].reshape(tiles, blocks, 4, 8, 4)
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-2)  # [t, b, j, c, half, i]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(tiles * 8, blocks * 32).float()
    d = packed[..., 128:144].contiguous().view(torch.float16).float()  # [t, b, 8]
    m = packed[..., 144:160].contiguous().view(torch.float16).float()
    d = d.permute(0, 2, 1).reshape(tiles * 8, blocks).repeat_interleave(32, dim=1)
    m = m.permute(0, 2, 1).reshape(tiles * 8, blocks).repeat_interleave(32, dim=1)
    return (q * d + m)[:out_features]


def test_oracle_rounds_each_block_within_half_a_step_and_keeps_its_ends():
    x = _rand(3, 64) * torch.tensor([1.0] * 32 + [100.0] * 32)  # the second block 100x larger
    rounded = reference.q4_1_round(x)
    blocks = x.reshape(3, 2, 32)
    step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
    assert ((rounded - x).reshape(3, 2, 32).abs() <= step / 2 + step * 1e-2).all()  # + the fp16 rounding of d, m
    assert torch.equal(reference.q4_1_round(rounded), rounded)  # already on the grid: the same blocks again
    assert torch.equal(reference.q4_1_round(torch.full((1, 32), 0.3)), torch.full((1, 32), 0.3).half().float())
    with pytest.raises(ValueError, match="multiple of 32"):
        reference.q4_1_round(torch.zeros(2, 48))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 70])
@pytest.mark.parametrize("out_features,in_features", [(8, 32), (13, 64), (960, 576)])
def test_q4_1_linear_matches_the_oracle(rows, out_features, in_features):
    x, w = _rand(rows, in_features), _rand(out_features, in_features, seed=1, scale=0.05)
    packed = cpu_ops.q4_1_pack_weight(w)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-out_features // 8), in_features // 32, 160)
    got = cpu_ops.q4_1_linear(x, packed, out_features)
    want = reference.q4_1_linear(x, w)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_packed_weight_is_exactly_the_oracles_rounding():
    w = _rand(21, 96, seed=4) * torch.linspace(0.01, 10, 96)  # blocks of very different ranges
    w[3, 32:64] = 0.7  # a constant block: d = 0
    packed = cpu_ops.q4_1_pack_weight(w)
    assert torch.equal(_unpack(packed, 21), reference.q4_1_round(w))
    # padding rows 21..23 (tile 2, columns 5..7): d = m = 0
    assert not packed[2, :, 128 + 2 * 5:144].any() and not packed[2, :, 144 + 2 * 5:160].any()


def test_strided_rows_other_dtypes_no_rows_and_bad_shapes():
    wide = _rand(5, 128)
    x = wide[:, :64]  # rows 128 apart
    w = _rand(16, 64, seed=2)
    packed = cpu_ops.q4_1_pack_weight(w)
    torch.testing.assert_close(cpu_ops.q4_1_linear(x, packed, 16), reference.q4_1_linear(x, w), rtol=1e-5, atol=1e-4)
    half = cpu_ops.q4_1_linear(x.bfloat16(), packed, 16)  # cast to float32 first
    torch.testing.assert_close(half, reference.q4_1_linear(x.bfloat16().float(), w), rtol=1e-5, atol=1e-4)
    assert cpu_ops.q4_1_linear(torch.zeros(0, 64), packed, 16).shape == (0, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.q4_1_pack_weight(torch.zeros(8, 40))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_ops.q4_1_linear(torch.zeros(2, 32), packed, 16)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_ops.q4_1_linear(torch.zeros(2, 64), packed, 24)


def test_the_default_ggufs_q4_1_blocks_come_back_unchanged():
    """Re-quantizing what the loader dequantized from the GGUF's Q4_1 blocks gives those
    blocks again, so --quantization q4_1 runs the file's own weights."""
    gguf = pytest.importorskip("gguf")
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    raw = np.asarray(tensor.data)  # [576, 1536 / 32 * 20] bytes: per block fp16 d, fp16 m, 16 bytes of nibbles
    weight = torch.from_numpy(gguf.quants.dequantize(raw, tensor.tensor_type).astype(np.float32))
    packed = cpu_ops.q4_1_pack_weight(weight)
    assert torch.equal(_unpack(packed, weight.shape[0]), weight)
    blocks = torch.from_numpy(raw.reshape(weight.shape[0], -1, 20).copy())
    d_file = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)  # [576, 48]
    d_packed = packed[..., 128:144].contiguous().view(torch.float16).permute(0, 2, 1).reshape(-1, 48)
    assert torch.equal(d_packed[: weight.shape[0]], d_file)  # the file's own scales
