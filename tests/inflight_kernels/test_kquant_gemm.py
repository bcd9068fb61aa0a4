"""The K-quant GEMM over a GGUF file's own blocks (``inflight_kernels/cpu/kquant_gemm.cpp``)
against the ``gguf`` package's dequantized weights, for every K type, row count and fused
layout; and its row dequantization (the token embedding's lookup).

gguf-py cannot quantize K types, so the blocks are random bytes with small finite fp16
scales: any such block is a valid one, and random bytes reach every bit of the layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import inflight_kernels
from inflight_kernels import reference

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not inflight_kernels.cpu_kernels_available(), reason="CPU kernels not built")

TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# offsets of each block's fp16 fields (ggml-common.h block_q2_K .. block_q6_K)
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[rows, cols / 256 * block bytes]`` of valid ``kind`` blocks."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        scale = (rng.uniform(0.5, 1.0, (rows, cols // block)) * 1e-2).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 17])
def test_each_type_matches_the_dequantized_weights(kind, rows):
    blocks = random_blocks(kind, 40, 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out = inflight_kernels.kquant_linear(x, [blocks], [TYPES[kind]])
    expected = reference.kquant_linear(x, [blocks], [TYPES[kind]])
    assert out.shape == (rows, 40) and out.dtype == torch.float32
    # int16 activations per 32 values: relative error about 2e-5 of the largest output
    assert relative_error(out, expected) < 2e-4


def test_a_fused_projection_of_mixed_types_writes_each_part_into_its_columns():
    """Q4_K_M's q/k in Q4_K and v in Q6_K: one call, each part's rows in its own columns of a
    wider output (a column slice), equal to the parts computed alone."""
    # 20 + 12 + 17 rows: the kernel's blocks of 16 rows of W straddle the parts
    q, k, v = random_blocks("Q4_K", 20, 256, 1), random_blocks("Q4_K", 12, 256, 2), random_blocks("Q6_K", 17, 256, 3)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    wide = torch.full((5, 55), 7.0)
    inflight_kernels.kquant_linear(x, [q, k, v], [12, 12, 14], out=wide[:, 3:52])
    alone = torch.cat([inflight_kernels.kquant_linear(x, [b], [t]) for b, t in ((q, 12), (k, 12), (v, 14))], dim=1)
    assert torch.equal(wide[:, 3:52], alone)
    assert torch.all(wide[:, :3] == 7.0) and torch.all(wide[:, 52:] == 7.0)
    assert relative_error(alone, reference.kquant_linear(x, [q, k, v], [12, 12, 14])) < 2e-4


@pytest.mark.parametrize("kind", list(TYPES))
def test_a_rows_result_does_not_depend_on_the_batch(kind):
    """Batch invariance: each row of a 19-row product (the many-rows path: rows of W unpacked in
    blocks; on AVX-512, 8 rows a call and K in chunks of 4 super-blocks, so 19 rows and 6
    super-blocks reach both remainders) equals the same row computed alone (one row: unpacked
    in registers from the file's bytes where the type has a vector source), bit for bit."""
    blocks = random_blocks(kind, 24, 1536)
    x = torch.randn(19, 1536, generator=torch.Generator().manual_seed(5))
    together = inflight_kernels.kquant_linear(x, [blocks], [TYPES[kind]])
    for r in range(19):
        assert torch.equal(inflight_kernels.kquant_linear(x[r:r + 1], [blocks], [TYPES[kind]])[0], together[r])


@pytest.mark.parametrize("kind", list(TYPES))
def test_one_and_two_rows_equal_the_same_rows_among_more(kind):
    """One and two rows (on AVX-512 Q4_K and Q6_K take kquant_planes.h's byte planes there) equal
    the same rows in a three-row product (dot512's scaled weights) and in a 19-row one, bit for
    bit, on two blocks of 256 values with every activation extreme somewhere."""
    blocks = random_blocks(kind, 33, 512, seed=7)
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(9))
    x[0, ::7] = 40.0  # one value per super-block far above the rest: the int16 extremes
    x[1, 3::11] = -40.0
    together = inflight_kernels.kquant_linear(x, [blocks], [TYPES[kind]])
    three = inflight_kernels.kquant_linear(x[:3], [blocks], [TYPES[kind]])
    two = inflight_kernels.kquant_linear(x[:2], [blocks], [TYPES[kind]])
    one = torch.cat([inflight_kernels.kquant_linear(x[r:r + 1], [blocks], [TYPES[kind]]) for r in range(2)])
    assert torch.equal(one, two) and torch.equal(two, three[:2]) and torch.equal(three, together[:3])
    assert relative_error(one, reference.kquant_linear(x[:2], [blocks], [TYPES[kind]])) < 2e-4


def extreme_blocks(kind: str, rows: int, cols: int) -> torch.Tensor:
    """Blocks whose every weight times its group scale is the format's largest magnitude: Q6_K with
    q = 0 (q - 32 = -32) and scales -128; Q4_K with nibbles 15 and 6-bit scales 63; d = 1e-2."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = np.zeros((rows, cols // block, size), dtype=np.uint8)
    if kind == "Q6_K":
        raw[:, :, 192:208] = 0x80
    else:
        raw[:, :, 4:16] = 0xFF  # every 6-bit scale and minimum 63
        raw[:, :, 16:144] = 0xFF
    for offset in F16_FIELDS[kind]:
        raw[:, :, offset:offset + 2] = np.array([1e-2], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_the_largest_weights_against_the_largest_activations(kind):
    """The int32 bound of a super-block's lane (16 products of the largest scaled weight and the
    largest int16 activation) on every path: no int16 saturation in the planes' pair sums, no
    int32 overflow in any lane; each row agrees with the oracle and across row counts."""
    blocks = extreme_blocks(kind, 20, 512)
    x = torch.full((5, 512), -3.0)
    x[1] = 3.0
    x[2, 1::2] = -3.0  # alternating signs
    x[3, ::5] = 0.0
    out = inflight_kernels.kquant_linear(x, [blocks], [TYPES[kind]])
    assert relative_error(out, reference.kquant_linear(x, [blocks], [TYPES[kind]])) < 2e-4
    for r in range(5):
        assert torch.equal(inflight_kernels.kquant_linear(x[r:r + 1], [blocks], [TYPES[kind]])[0], out[r])


def test_the_avx2_build_on_a_cpu_with_avx512(monkeypatch, tmp_path):
    """kquant_gemm.cpp built alone with the options of ``INFLIGHT_CPU_ISA=avx2`` (so its AVX2
    products, not kquant_avx512.h's) matches the oracle and is batch invariant: on a CPU with
    AVX-512 the kernels' own build never runs that code."""
    from torch.utils import cpp_extension

    import inflight_kernels.cpu.build as cpu_build

    if "avx2" not in cpu_build._cpu_flags() or "avx512bw" not in cpu_build._cpu_flags():
        pytest.skip("the kernels' own build already runs the AVX2 products here (or cannot)")
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx2")
    source = cpu_build.Path(cpu_build.__file__).parent / "kquant_gemm.cpp"
    module = cpp_extension.load_inline(
        "inflight_kquant_avx2", cpp_sources=[f'#include "{source}"'], functions=["kquant_linear"],
        extra_cflags=cpu_build.compile_options(), extra_ldflags=["-fopenmp"], build_directory=str(tmp_path))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    for kind, ggml_type in TYPES.items():
        blocks = random_blocks(kind, 16, 512)
        out = torch.empty(6, 16)
        module.kquant_linear(out, x, [blocks], [ggml_type], 0)
        assert relative_error(out, reference.kquant_linear(x, [blocks], [ggml_type])) < 2e-4, kind
        alone = torch.empty(1, 16)
        module.kquant_linear(alone, x[4:5], [blocks], [ggml_type], 0)
        assert torch.equal(alone[0], out[4]), kind


@pytest.mark.parametrize("kind", list(TYPES))
def test_dequantized_rows_equal_the_gguf_package(kind):
    blocks = random_blocks(kind, 12, 512)
    ids = torch.tensor([11, 0, 5, 5])
    rows = inflight_kernels.kquant_dequantize_rows(blocks, TYPES[kind], ids)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind]).copy())[ids]
    assert torch.equal(rows, expected.float())


def test_zero_activations_and_strided_rows():
    blocks = random_blocks("Q5_K", 8, 512)
    x = torch.zeros(3, 1024)
    x[1, :512] = torch.randn(512)
    out = inflight_kernels.kquant_linear(x[:, :512], [blocks], [13])  # rows strided by 1024
    assert torch.equal(out[0], torch.zeros(8)) and torch.equal(out[2], torch.zeros(8))
    assert relative_error(out[1:2], reference.kquant_linear(x[1:2, :512], [blocks], [13])) < 2e-4


def test_bad_arguments_raise():
    blocks = random_blocks("Q4_K", 4, 256)
    with pytest.raises(RuntimeError, match="bytes per row"):
        inflight_kernels.kquant_linear(torch.randn(1, 512), [blocks], [12])
    with pytest.raises(RuntimeError, match="unknown K-quant type"):
        inflight_kernels.kquant_linear(torch.randn(1, 256), [blocks], [8])
    with pytest.raises(RuntimeError, match="out of range"):
        inflight_kernels.kquant_dequantize_rows(blocks, 12, torch.tensor([4]))


needs_tiles = pytest.mark.skipif(not inflight_kernels.cpu_kquant_bf16(),
                                 reason="no bfloat16 tiles in this build (needs AVX-512 F, BW and BF16)")


def bf16_reference(x: torch.Tensor, blocks: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """What the tiles compute: activations and dequantized weights rounded to bfloat16, exact sums."""
    w = torch.cat([reference.kquant_dequantize_rows(b, t) for b, t in zip(blocks, types)])
    return x.bfloat16().double() @ w.bfloat16().double().T


@needs_tiles
@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rows", [16, 33])
def test_bfloat16_tiles_compute_the_bfloat16_rounded_product(kind, rows):
    """From dense_min_rows rows the blocks are dequantized into bfloat16 tiles per call: the
    result is the bfloat16-rounded product to float32's precision, for every type, in a column
    slice of a wider output, with parts of two types straddling the 16-row tiles and K = 2304
    (two passes of 8 super-blocks, the second partial)."""
    parts = [random_blocks(kind, 37, 2304, 1), random_blocks("Q4_K", 20, 2304, 2)]
    types = [TYPES[kind], TYPES["Q4_K"]]
    x = torch.randn(rows, 2304, generator=torch.Generator().manual_seed(rows))
    wide = torch.full((rows, 61), 7.0)
    inflight_kernels.kquant_linear(x, parts, types, out=wide[:, 2:59], dense_min_rows=16)
    assert relative_error(wide[:, 2:59], bf16_reference(x, parts, types)) < 2e-6
    assert torch.all(wide[:, :2] == 7.0) and torch.all(wide[:, 59:] == 7.0)
    # and the bfloat16 rounding keeps it near the exact product (the int16 path: about 2e-5)
    assert relative_error(wide[:, 2:59], reference.kquant_linear(x, parts, types)) < 2e-2


@needs_tiles
def test_fewer_rows_than_dense_min_rows_keep_the_int16_products():
    blocks = random_blocks("Q4_K", 24, 512)
    x = torch.randn(15, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(inflight_kernels.kquant_linear(x, [blocks], [12], dense_min_rows=16),
                       inflight_kernels.kquant_linear(x, [blocks], [12]))
    assert not torch.equal(inflight_kernels.kquant_linear(x, [blocks], [12], dense_min_rows=15),
                           inflight_kernels.kquant_linear(x, [blocks], [12]))


@needs_tiles
def test_a_rows_result_on_the_tiles_does_not_depend_on_the_other_rows():
    """Among steps that all take the tiles, a row's result is the same bit for bit: each output
    sums its pairs in k order whatever the row count (rows 4 at a time, any remainder)."""
    blocks = random_blocks("Q6_K", 40, 1024)
    x = torch.randn(23, 1024, generator=torch.Generator().manual_seed(2))
    together = inflight_kernels.kquant_linear(x, [blocks], [14], dense_min_rows=8)
    for first in (0, 3, 15):
        alone = inflight_kernels.kquant_linear(x[first:first + 8], [blocks], [14], dense_min_rows=8)
        assert torch.equal(alone, together[first:first + 8])


needs_f32 = pytest.mark.skipif(not inflight_kernels.cpu_kquant_f32(),
                               reason="no float32 K-quant tiles in this build (needs AVX2 and FMA, no AVX-512)")


@needs_f32
@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rows", [8, 9, 16, 33])
def test_float32_tiles_compute_the_exact_product(kind, rows):
    """On AVX2 CPUs, from dense_min_rows rows the blocks are dequantized to float32 per call and
    the activations are not rounded: the product of the dequantized weights to float32's
    precision (the int16 path: about 2e-5), for every type, in a column slice of a wider output,
    with parts of two types straddling the groups of 48 rows of W, K = 2304 (three runs of K,
    the last partial) and activation panels of 16 and of 8 rows."""
    parts = [random_blocks(kind, 37, 2304, 1), random_blocks("Q4_K", 20, 2304, 2)]
    types = [TYPES[kind], TYPES["Q4_K"]]
    x = torch.randn(rows, 2304, generator=torch.Generator().manual_seed(rows))
    wide = torch.full((rows, 61), 7.0)
    inflight_kernels.kquant_linear(x, parts, types, out=wide[:, 2:59], dense_min_rows=8)
    assert relative_error(wide[:, 2:59], reference.kquant_linear(x, parts, types)) < 5e-6
    assert torch.all(wide[:, :2] == 7.0) and torch.all(wide[:, 59:] == 7.0)


@needs_f32
def test_a_rows_result_on_the_float32_tiles_does_not_depend_on_the_other_rows():
    """Among steps that all take the float32 tiles, a row's result is the same bit for bit,
    whichever panel (16 or 8 rows) and lane it lands in; fewer rows keep the int16 products."""
    blocks = random_blocks("Q6_K", 100, 1280)
    x = torch.randn(37, 1280, generator=torch.Generator().manual_seed(2))
    together = inflight_kernels.kquant_linear(x, [blocks], [14], dense_min_rows=8)
    for first, count in ((0, 8), (3, 8), (15, 20), (29, 8)):
        alone = inflight_kernels.kquant_linear(x[first:first + count], [blocks], [14], dense_min_rows=8)
        assert torch.equal(alone, together[first:first + count])
    assert torch.equal(inflight_kernels.kquant_linear(x[:7], [blocks], [14], dense_min_rows=8),
                       inflight_kernels.kquant_linear(x[:7], [blocks], [14]))
