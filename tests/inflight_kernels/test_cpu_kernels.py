"""The compiled CPU decode kernel (inflight_kernels/cpu/paged_attention.cpp via
inflight_kernels.cpu.ops) against the torch oracle inflight_kernels.reference.paged_attention.

These tests fail, not skip, when the kernel does not build: the CI machine has
a C++ compiler, and a silent fallback would hide a broken build. Only
INFLIGHT_CPU_KERNELS=0 (the documented off switch) skips them."""

import os

import pytest
import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), "the CPU kernels did not build; see the warning logged by inflight_kernels.cpu.build"


def _case(dtype, lens, *, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0, spare_blocks=1):
    g = torch.Generator().manual_seed(seed)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    max_blocks = max(1, -(-max(lens) // block_size)) + spare_blocks
    num_blocks = len(lens) * max_blocks + 3
    kc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables.to(torch.int32), lens_t


def _run(q, kc, vc, tables, lens, scale):
    return cpu_ops.paged_attention(q, kc, vc, tables, lens, scale, torch.full_like(q, float("nan")))


def _assert_close(out, q, kc, vc, tables, lens, scale):
    """Against the oracle computed in float32 from the same (rounded) inputs:
    the only differences left are summation order and the final rounding."""
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), tables, lens, scale)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol), (out.float() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [
    [1, 2, 15, 16, 17, 31, 32, 33, 200],  # page edges: partial pages and the 16-token tiles
    [1000, 3, 40, 40, 1, 40],  # one long among short ones
    [256] * 12,
])
def test_matches_reference(dtype, lens):
    case = _case(dtype, lens, seed=len(lens))
    _assert_close(_run(*case, 0.125), *case, 0.125)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (8, 8, 64), (8, 1, 64), (12, 4, 64), (16, 2, 64), (15, 5, 64),  # GQA groups 1..8, chunked above 4
    (4, 2, 32), (32, 4, 32), (6, 2, 96), (8, 2, 128), (12, 3, 128), (4, 1, 256), (3, 3, 256),
])
def test_gqa_groups_and_head_dims(heads, kv_heads, head_dim):
    case = _case(torch.bfloat16, [5, 16, 47, 130], heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=heads)
    _assert_close(_run(*case, head_dim**-0.5), *case, head_dim**-0.5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size):
    case = _case(torch.float32, [1, 7, 8, 9, 33, 100], block_size=block_size, seed=block_size)
    _assert_close(_run(*case, 0.125), *case, 0.125)


def test_zero_length_rows_are_zero_and_others_unaffected():
    q, kc, vc, tables, lens = _case(torch.bfloat16, [0, 20, 0, 5])
    out = _run(q, kc, vc, tables, lens, 0.125)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0
    _assert_close(out, q, kc, vc, tables, lens, 0.125)


def test_reads_only_slots_inside_the_context():
    """NaN in blocks no sequence uses (spare table entries included) and huge
    values past each sequence's end inside its last block never reach the output."""
    q, kc, vc, tables, lens = _case(torch.float32, [3, 20, 16, 64], seed=7, spare_blocks=2)
    used = {int(tables[s, b]) for s, n in enumerate(lens.tolist()) for b in range(-(-n // 16))}
    ref = reference.paged_attention(q, kc, vc, tables, lens, 0.125)
    for blk in set(range(kc.shape[0])) - used:
        kc[blk], vc[blk] = float("nan"), float("nan")
    for s, n in enumerate(lens.tolist()):
        blk, off = int(tables[s, (n - 1) // 16]), (n - 1) % 16 + 1
        kc[blk, :, off:], vc[blk, :, off:] = 1e30, float("nan")
    assert torch.allclose(_run(q, kc, vc, tables, lens, 0.125), ref, atol=2e-6, rtol=2e-6)


def test_context_longer_than_the_table_is_clamped():
    q, kc, vc, tables, lens = _case(torch.float32, [40], spare_blocks=0)  # table holds 3 blocks = 48 tokens
    too_long = torch.tensor([500], dtype=torch.int32)
    expected = reference.paged_attention(q, kc, vc, tables, torch.tensor([48], dtype=torch.int32), 0.125)
    assert torch.allclose(_run(q, kc, vc, tables, too_long, 0.125), expected, atol=2e-6, rtol=2e-6)


def test_same_result_on_one_and_two_threads():
    """Each (sequence, KV head) is computed by one thread in a fixed order, so
    the split between threads does not change a single bit."""
    case = _case(torch.bfloat16, [1000, 3, 40, 17, 256, 90, 1], seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(*case, 0.125)
        torch.set_num_threads(2)
        two = _run(*case, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequence_gets_the_same_bits_in_a_small_and_a_large_batch(dtype):
    """Few sequences run one task per (sequence, KV head); from two sequences per
    thread a task takes all of a sequence's KV heads, page-major. Both give each head
    the same operations in the same order, so a sequence's output does not depend on
    which its batch chose (batch invariance)."""
    q, kc, vc, tables, lens = _case(dtype, [37, 300, 16, 5, 129, 64, 200, 1, 90], seed=13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        large = _run(q, kc, vc, tables, lens, 0.125)
        small = _run(q[:3].contiguous(), kc, vc, tables[:3].contiguous(), lens[:3].contiguous(), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(small, large[:3])
    _assert_close(large, q, kc, vc, tables, lens, 0.125)


def test_int64_tables_and_non_contiguous_query_are_accepted():
    q, kc, vc, tables, lens = _case(torch.bfloat16, [5, 30])
    wide = torch.cat([q, q], dim=-1)[..., : q.shape[-1]]  # same values, not contiguous
    assert not wide.is_contiguous()
    out = cpu_ops.paged_attention(wide, kc, vc, tables.long(), lens.long(), 0.125, torch.empty_like(q))
    assert torch.equal(out, _run(q, kc, vc, tables, lens, 0.125))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float32_query_over_a_half_size_cache_stays_float32(cache_dtype):
    """float32 compute with a bf16/fp16 KV cache: q is not rounded to the
    cache dtype, nor is the output; only the cached K/V are. The result is
    the float32 kernel's on the caches widened to float32."""
    q, kc, vc, tables, lens = _case(cache_dtype, [9, 40, 3])
    q = q.float() + 1e-3 * torch.randn(q.shape)  # not representable in the cache dtype
    out = cpu_ops.paged_attention(q, kc, vc, tables, lens, 0.125, torch.empty(q.shape))
    assert out.dtype == torch.float32
    widened = _run(q, kc.float(), vc.float(), tables, lens, 0.125)
    torch.testing.assert_close(out, widened, rtol=1e-6, atol=1e-6)
    rounded_q = _run(q.to(cache_dtype), kc, vc, tables, lens, 0.125).float()
    assert not torch.allclose(out, rounded_q, rtol=0, atol=1e-5)


def test_bad_inputs_raise():
    q, kc, vc, tables, lens = _case(torch.bfloat16, [5, 30])
    module = cpu_build.load()
    with pytest.raises(RuntimeError, match="share the caches' dtype, or be float32"):
        module.paged_attention_decode(torch.empty_like(q), q, kc.float(), vc.float(), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="share the caches' dtype"):  # float32 q, bf16 out
        module.paged_attention_decode(torch.empty_like(q), q.float(), kc, vc, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="do not match the batch"):
        module.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables[:1], lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_ops.paged_attention(q[..., :32].contiguous(), kc, vc, tables, lens, 0.1, torch.empty_like(q[..., :32]))
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.paged_attention_decode(torch.empty_like(q), q, kc, vc, bad, lens, 0.1)
    bad[1, 0] = -1
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.paged_attention_decode(torch.empty_like(q), q, kc, vc, bad, lens, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        module.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables.long(), lens, 0.1)


def test_supports():
    q, kc, _, _, _ = _case(torch.bfloat16, [4])
    flags = cpu_build._isa_flags()  # the CPU's, capped by INFLIGHT_CPU_ISA
    expected = ("avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
                else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar")
    assert cpu_ops.vector_isa() == expected
    assert cpu_ops.fast_attention() == (expected != "scalar")
    assert cpu_ops.supports(q, kc) == (expected != "scalar")  # the scalar build leaves attention to torch
    assert not cpu_ops.supports(torch.empty(1, 9, 48), torch.empty(1, 3, 16, 48))  # head_dim 48
    assert not cpu_ops.supports(q, kc.to(torch.float64))


def test_isa_cap(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: {"avx512f", "avx512bw", "avx2", "fma", "f16c", "sse4_2"})
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx2")
    assert cpu_build._isa_flags() == {"avx2", "fma", "f16c", "sse4_2"}
    assert "-mavx512f" not in cpu_build.compile_options() and "-mavx2" in cpu_build.compile_options()
    monkeypatch.setenv(cpu_build.ISA_ENV, "Scalar")
    assert cpu_build._isa_flags() == {"sse4_2"}
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_ISA='avx1024': expected one of avx512, avx2, scalar"):
        cpu_build.compile_options()


@pytest.mark.parametrize("code, remembered", [(-4, True), (cpu_build.SMOKE_MISMATCH_EXIT, True), (1, False)],
                         ids=["SIGILL", "mismatch", "compile-error"])
def test_a_failed_smoke_run_is_remembered_unless_it_may_pass_later(monkeypatch, tmp_path, code, remembered):
    import subprocess

    calls = []

    def fake_run(argv, env, folder):  # the build-and-smoke child (run with progress reports)
        calls.append(argv)
        return subprocess.CompletedProcess(argv, code, "", "boom")

    monkeypatch.setattr(cpu_build, "_run_with_progress", fake_run)
    assert not cpu_build._smoke_ok(tmp_path)
    assert not cpu_build._smoke_ok(tmp_path)
    assert len(calls) == (1 if remembered else 2)
    assert bool(list(tmp_path.glob("smoke-failed-*"))) == remembered


def test_a_query_in_another_half_precision_is_widened_not_rounded():
    """bf16 compute over a float16 cache (allowed on the CPU): the query goes
    in as float32, so bf16 values beyond float16's range stay finite."""
    q, kc, vc, tables, lens = _case(torch.float16, [9, 40])
    q = q.to(torch.bfloat16) * 1e5  # beyond float16's 65504
    out = cpu_ops.paged_attention(q, kc, vc, tables, lens, 1e-5, torch.empty(q.shape, dtype=torch.bfloat16))
    assert torch.isfinite(out.float()).all()
    widened = _run(q.float(), kc, vc, tables, lens, 1e-5).to(torch.bfloat16)
    assert torch.equal(out, widened)


def test_bf16_dot_scores_agree_with_the_float_path():
    """With AVX-512 BF16 a bf16 query over a bf16 cache takes vdpbf16ps for its scores (exact
    products, float32 sums); the float32-query path over the same cache computes the same
    products in another order, so the two differ by the output's bf16 rounding at most."""
    flags = cpu_build._isa_flags()
    assert cpu_build.load().bf16_dot == ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags)
    for head_dim in (64, 128):  # two and four bf16 registers per row; contexts with partial tiles
        q, kc, vc, tables, lens = _case(torch.bfloat16, [1, 15, 16, 17, 300], head_dim=head_dim, seed=3)
        out = _run(q, kc, vc, tables, lens, head_dim ** -0.5)
        widened = _run(q.float(), kc, vc, tables, lens, head_dim ** -0.5)
        torch.testing.assert_close(out.float(), widened, rtol=8e-3, atol=8e-3)
        _assert_close(out, q, kc, vc, tables, lens, head_dim ** -0.5)
