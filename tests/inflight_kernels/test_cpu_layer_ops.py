"""The fused element-wise CPU kernels (inflight_kernels/cpu/layer_ops.cpp) against the
torch code they replace (inflight_kernels.reference, which worker/model/layers.py uses), and the
decoder's fused CPU path against its torch path. Like test_cpu_kernels.py,
these fail when the kernels do not build; only INFLIGHT_CPU_KERNELS=0 skips."""

import os

import pytest
import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops
from inflight_kernels.reference import apply_rope, rms_norm, silu_mul
from worker.model.layers import rope_cos_sin

pytestmark = pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), "the CPU kernels did not build; see the warning logged by inflight_kernels.cpu.build"


def _ulp_close(a, b, dtype):
    """Equal up to one rounding step of ``dtype`` (float32 summation order
    inside a row may move a value across a rounding boundary)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_rms_norm(dtype, rows):
    x, w = _rand(rows, 576, dtype=dtype), _rand(576, dtype=dtype, seed=1)
    assert _ulp_close(cpu_ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype):
    residual, delta = _rand(7, 64, dtype=dtype), _rand(7, 64, dtype=dtype, seed=1)
    w = _rand(64, dtype=dtype, seed=2)
    expected_sum = residual + delta
    out = cpu_ops.add_rms_norm(residual, delta, w, 1e-6)
    assert torch.equal(residual, expected_sum)  # one rounding of an exact float sum: bit-equal
    assert _ulp_close(out, rms_norm(expected_sum, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_fused_qkv_rows(dtype):
    heads, kv_heads, d, n = 9, 3, 64, 11
    qkv = _rand(n, (heads + 2 * kv_heads) * d, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 511, 512, 1000, 4095, 8191])
    cos, sin = rope_cos_sin(positions, d, 10000.0, dtype)
    q = apply_rope(qkv[:, : heads * d].reshape(n, heads, d), cos, sin)
    k = apply_rope(qkv[:, heads * d: (heads + kv_heads) * d].reshape(n, kv_heads, d), cos, sin)
    v = qkv[:, (heads + kv_heads) * d:].clone()
    cpu_ops.rope_qk(qkv, cos, sin, heads + kv_heads, d)
    assert torch.equal(qkv[:, : heads * d].reshape(n, heads, d), q)  # same rounding points: bit-equal
    assert torch.equal(qkv[:, heads * d: (heads + kv_heads) * d].reshape(n, kv_heads, d), k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = _rand(9, 2 * 1536, dtype=dtype) * 4  # wide range: exp of large |x|
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    out = cpu_ops.silu_mul(gate_up)
    assert out.shape == (9, 1536)
    assert _ulp_close(out, silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_from_strided_views(dtype):
    n, kvh, d, bs = 6, 3, 64, 16
    fused = _rand(n, 5 * kvh * d, dtype=dtype)  # key and value are views into wider rows
    key = fused[:, kvh * d: 2 * kvh * d].view(n, kvh, d)
    value = fused[:, 3 * kvh * d: 4 * kvh * d].view(n, kvh, d)
    slots = torch.tensor([0, 17, -1, 35, 5, 63])
    got = [torch.zeros(4, kvh, bs, d, dtype=dtype) for _ in range(2)]
    want = [torch.zeros(4, kvh, bs, d, dtype=dtype) for _ in range(2)]
    cpu_ops.reshape_and_cache(key, value, *got, slots)
    reference.reshape_and_cache(key.contiguous(), value.contiguous(), *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reshape_and_cache_rejects_a_slot_beyond_the_cache():
    key = torch.zeros(1, 1, 64)
    caches = [torch.zeros(2, 1, 16, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="beyond the cache"):
        cpu_ops.reshape_and_cache(key, key, *caches, torch.tensor([32]))


def test_shape_checks():
    with pytest.raises(RuntimeError, match="shapes or dtypes"):
        cpu_ops.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(RuntimeError, match="shapes or dtypes"):
        cpu_ops.rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="shapes or dtypes"):
        cpu_ops.rope_qk(torch.zeros(2, 64), torch.zeros(2, 64), torch.zeros(2, 64), 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_fused_path_matches_torch_path(dtype, monkeypatch):
    """A tiny model's logits over a prefill (chunked: two spans) and a decode
    step, fused CPU path against the torch path on the same weights."""
    from worker.runner_io import ModelInput, ScheduledChunk
    from worker.model.model_runner import tiny_random_runner

    steps = [ModelInput(prefills=[ScheduledChunk(0, list(range(3, 40)), 0, [0, 1, 2]),
                                  ScheduledChunk(1, list(range(50, 60)), 0, [5])]),
             ModelInput(prefills=[ScheduledChunk(0, [7, 8, 9], 37, [0, 1, 2])],
                        decodes=[ScheduledChunk(1, [61], 10, [5])])]
    results = []
    for fused in (True, False):
        runner = tiny_random_runner(seed=4, dtype=dtype, hidden_size=128, num_heads=4, num_kv_heads=2)
        if not fused:
            monkeypatch.setattr(cpu_ops, "available", lambda: False)
        assert runner.model.fused == fused
        results.append([runner.execute(step).logits for step in steps])
    for got, want in zip(*results):
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("inter", [1, 7, 37])
def test_silu_mul_widths_that_leave_a_vector_tail(inter):
    """The float32 vector loop (8 or 16 lanes) plus its scalar tail."""
    gate_up = _rand(5, 2 * inter, dtype=torch.float32) * 4
    assert _ulp_close(cpu_ops.silu_mul(gate_up), silu_mul(gate_up), torch.float32)
