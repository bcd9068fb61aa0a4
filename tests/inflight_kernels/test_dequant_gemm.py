"""The weight-only linear layers (inflight_kernels/cpu/dequant_gemm.cpp: Q4_1 and Q8_0 weights,
float32 activations) against their oracles (inflight_kernels.reference.q4_1_dequant_linear,
q8_0_dequant_linear), their batch invariance, and the AVX2 and scalar builds of the
same sums. Like test_cpu_kernels.py, these fail when the kernels do not build; only
INFLIGHT_CPU_KERNELS=0 skips."""

import os

import pytest
import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")

# tile counts: 1 (a lone partial tile), 2, an odd 17 (a tile without a partner for the
# 16-lane path), 120 (qkv of SmolLM2-135M); rows past 64 cross a row block
SHAPES = [(8, 32), (13, 64), (136, 96), (960, 576)]


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _q4(x, w):
    return cpu_ops.q4_1_dequant_linear(x, cpu_ops.q4_1_pack_weight(w), w.shape[0])


def _q8(x, w):
    packed, scales = cpu_ops.q8_pack_weight(w)
    return cpu_ops.q8_0_dequant_linear(x, packed, scales, w.shape[0])


KERNELS = {"q4_1": (_q4, reference.q4_1_dequant_linear), "q8_0": (_q8, reference.q8_0_dequant_linear)}


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_matches_the_float64_oracle(kind, rows, out_features, in_features):
    kernel, oracle = KERNELS[kind]
    x, w = _rand(rows, in_features), _rand(out_features, in_features, seed=1, scale=0.05)
    got, want = kernel(x, w), oracle(x, w)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # float32 sums of K products against float64: a few ulps of the largest partial sum
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * in_features ** 0.5 * want.abs().max().item())


@pytest.mark.parametrize("kind", KERNELS)
def test_the_activations_are_not_rounded(kind):
    """The int8-activation kernels' answer is farther from the float64 product than this one's
    by orders of magnitude: the inputs are used as they are."""
    kernel, oracle = KERNELS[kind]
    x, w = _rand(4, 576), _rand(64, 576, seed=3, scale=0.05)
    packed_q8 = cpu_ops.q8_pack_weight(w)
    int8 = (cpu_ops.q4_1_linear(x, cpu_ops.q4_1_pack_weight(w), 64) if kind == "q4_1"
            else cpu_ops.q8_linear(x, *packed_q8, 64))
    want = oracle(x, w)
    assert (kernel(x, w) - want).abs().max() * 100 < (int8 - want).abs().max()


@pytest.mark.parametrize("kind", KERNELS)
def test_a_rows_result_does_not_depend_on_its_batch(kind):
    kernel, _ = KERNELS[kind]
    x, w = _rand(70, 576), _rand(136, 576, seed=5, scale=0.05)
    together = kernel(x, w)
    for row in (0, 7, 8, 63, 64, 69):
        assert torch.equal(kernel(x[row:row + 1], w)[0], together[row])
    assert torch.equal(kernel(x[5:14], w), together[5:14])


def test_strided_rows_other_dtypes_no_rows_and_bad_shapes():
    x = _rand(5, 128)[:, :64]  # rows 128 apart
    w = _rand(16, 64, seed=2)
    packed = cpu_ops.q4_1_pack_weight(w)
    torch.testing.assert_close(cpu_ops.q4_1_dequant_linear(x, packed, 16), reference.q4_1_dequant_linear(x, w))
    half = cpu_ops.q4_1_dequant_linear(x.bfloat16(), packed, 16)  # cast to float32 first
    torch.testing.assert_close(half, reference.q4_1_dequant_linear(x.bfloat16().float(), w))
    assert cpu_ops.q4_1_dequant_linear(torch.zeros(0, 64), packed, 16).shape == (0, 16)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_ops.q4_1_dequant_linear(torch.zeros(2, 96), packed, 16)
    q8, scales = cpu_ops.q8_pack_weight(w)
    with pytest.raises(RuntimeError, match="scales must be"):
        cpu_ops.q8_0_dequant_linear(torch.zeros(2, 64), q8, scales[:, :, :4].contiguous(), 16)
    with pytest.raises(RuntimeError, match="packed weight"):
        cpu_ops.q8_0_dequant_linear(torch.zeros(2, 64), packed, scales, 16)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_other_instruction_set_builds(isa, tmp_path, monkeypatch):
    """The 8-lane (AVX2) and scalar code of dequant_gemm.cpp, built alone with the options
    the kernels' build uses when capped at that instruction set, computes the same
    products as the oracle (the packing comes from the native build: its layout does not
    depend on the instruction set)."""
    from torch.utils import cpp_extension

    if isa == "avx2" and "avx2" not in cpu_build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(cpu_build.ISA_ENV, isa)
    folder = cpu_build.Path(cpu_build.__file__).parent
    sources = "\n".join(f'#include "{folder / name}"' for name in ("dequant_gemm.cpp", "dequant_gemm_bf16.cpp"))
    module = cpp_extension.load_inline(
        f"inflight_dequant_gemm_{isa}", cpp_sources=[sources],
        functions=["q4_1_dequant_linear", "q8_0_dequant_linear"], extra_cflags=cpu_build.compile_options(),
        extra_ldflags=["-fopenmp"], build_directory=str(tmp_path))
    x, w = _rand(9, 96), _rand(136, 96, seed=6, scale=0.05)
    for kind, (_, oracle) in KERNELS.items():
        got = torch.empty(9, 136)
        if kind == "q4_1":
            module.q4_1_dequant_linear(got, x, cpu_ops.q4_1_pack_weight(w), False)
        else:
            module.q8_0_dequant_linear(got, x, *cpu_ops.q8_pack_weight(w), False)
        torch.testing.assert_close(got, oracle(x, w), rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match="built without AVX-512 BF16"):  # these builds lack it
        module.q4_1_dequant_linear(torch.empty(9, 136), x, cpu_ops.q4_1_pack_weight(w), True)


needs_bf16 = pytest.mark.skipif(not cpu_ops.dequant_bf16(), reason="no AVX-512 BF16 build on this CPU")


def _q4_bf16(x, w):
    return cpu_ops.q4_1_dequant_linear(x, cpu_ops.q4_1_pack_weight(w), w.shape[0], bf16_activations=True)


def _q8_bf16(x, w):
    packed, scales = cpu_ops.q8_pack_weight(w)
    return cpu_ops.q8_0_dequant_linear(x, packed, scales, w.shape[0], bf16_activations=True)


BF16_KERNELS = {"q4_1": (_q4_bf16, reference.q4_1_dequant_linear),
                "q8_0": (_q8_bf16, reference.q8_0_dequant_linear)}


@needs_bf16
@pytest.mark.parametrize("kind", BF16_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 70])
@pytest.mark.parametrize("out_features,in_features", SHAPES + [(3072, 576)])
def test_bf16_activations_match_their_oracle(kind, rows, out_features, in_features):
    """The vdpbf16ps path (dequant_gemm_bf16.cpp) against the float64 product of the bfloat16-rounded
    activations and the exact Q4_1 or Q8_0 weights, for one-row chains (3072 columns: several
    groups), full and partial row blocks and a tile without a partner (17 tiles)."""
    kernel, oracle = BF16_KERNELS[kind]
    x, w = _rand(rows, in_features), _rand(out_features, in_features, seed=1, scale=0.05)
    got, want = kernel(x, w), oracle(x, w, bf16_activations=True)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # the 128 offset of each integer (see the kernel) costs float32 sums about 2^7 of headroom
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * in_features ** 0.5 * want.abs().max().item())


@needs_bf16
@pytest.mark.parametrize("kind", BF16_KERNELS)
def test_bf16_activations_are_rounded_and_batch_invariant(kind):
    kernel, oracle = BF16_KERNELS[kind]
    x, w = _rand(70, 576), _rand(136, 576, seed=5, scale=0.05)
    together = kernel(x, w)
    exact, rounded = oracle(x, w), oracle(x, w, bf16_activations=True)
    assert (together - rounded).abs().max() * 50 < (together - exact).abs().max()  # it did round
    for row in (0, 1, 7, 8, 63, 64, 69):
        assert torch.equal(kernel(x[row:row + 1], w)[0], together[row])
    assert torch.equal(kernel(x[5:14], w), together[5:14])
    assert torch.equal(kernel(x[2:5], w), together[2:5])


@pytest.mark.skipif(cpu_ops.dequant_bf16(), reason="this CPU has the AVX-512 BF16 build")
@pytest.mark.parametrize("kind", BF16_KERNELS)
def test_bf16_activations_refused_without_the_instruction(kind):
    with pytest.raises(RuntimeError, match="built without AVX-512 BF16"):
        BF16_KERNELS[kind][0](_rand(2, 64), _rand(16, 64, seed=2))


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)])
@pytest.mark.parametrize("rows", [1, 4, 8, 70])
def test_q8_0_every_byte_value_is_decoded_exactly(bf16, rows):
    """Q8_0 blocks holding every int8 value, -128 included (a GGUF file may store it; our own
    quantizer stops at -127), against the float64 product with the weights they encode, on the
    float32 path and the bfloat16-activation path (q + 128 through float32): both must give each
    value exactly."""
    out_features, in_features = 136, 64  # 17 tiles of 8 columns (one without a partner), 2 blocks
    packed, scales = cpu_ops.q8_pack_weight(_rand(out_features, in_features, seed=3))
    tiles, blocks = packed.shape[0], packed.shape[1]
    values = torch.arange(-128, 128, dtype=torch.int8)
    for t in range(tiles):
        for b in range(blocks):
            packed[t, b, :256] = values.roll(37 * t + 101 * b)
    scales.copy_(torch.rand(scales.shape, generator=torch.Generator().manual_seed(4)) * 0.01 + 0.001)
    # byte 32 j + 4 c + i of (tile t, block b): column 8 t + c, input 32 b + 4 j + i
    q = packed[:, :, :256].view(tiles, blocks, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(tiles * 8, in_features)
    weight = (q.double().view(tiles * 8, blocks, 32) * scales.double().permute(0, 2, 1).reshape(tiles * 8, blocks, 1))
    weight = weight.reshape(tiles * 8, in_features)[:out_features]
    x = _rand(rows, in_features, seed=6)
    want = (x.bfloat16() if bf16 else x).double() @ weight.T
    got = cpu_ops.q8_0_dequant_linear(x, packed, scales, out_features, bf16_activations=bf16)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
