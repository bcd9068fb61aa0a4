"""The KV cache's element dtype: how "auto" resolves, what the cache holds,
and that a float16 cache under float32 compute stays close to a float32 one
on every CPU attention path (compiled kernel, padded torch, varlen torch)."""

from __future__ import annotations

import pytest
import torch

from inflight_kernels.cpu import ops as cpu_ops
from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.kv_cache import KVCacheSpec
from worker.model.dtype import resolve_kv_cache_dtype
from worker.model.model_runner import tiny_random_runner


@pytest.mark.parametrize("fast", [True, False])
def test_auto_is_float16_only_for_float32_compute_on_a_cpu_with_the_kernel(monkeypatch, fast):
    monkeypatch.setattr(cpu_ops, "fast_attention", lambda: fast)
    expected = torch.float16 if fast else torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 64) == expected
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 80) == torch.float32  # no kernel for this head size
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu", 64) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float16, "cpu", 64) == torch.float16


@pytest.mark.parametrize("dot", [True, False])
def test_auto_is_bfloat16_for_q8_0_where_the_kernel_has_the_bf16_dot_path(monkeypatch, dot):
    monkeypatch.setattr(cpu_ops, "fast_attention", lambda: True)
    monkeypatch.setattr(cpu_ops, "bf16_dot", lambda: dot)
    expected = torch.bfloat16 if dot else torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 64, "q8_0") == expected
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 64) == torch.float16  # no quantization
    assert resolve_kv_cache_dtype("float16", torch.float32, "cpu", 64, "q8_0") == torch.float16  # asked for


@pytest.mark.parametrize("dot", [True, False])
def test_auto_is_bfloat16_for_gguf_only_with_bfloat16_activations(monkeypatch, dot):
    monkeypatch.setattr(cpu_ops, "fast_attention", lambda: True)
    monkeypatch.setattr(cpu_ops, "bf16_dot", lambda: dot)
    rounded = torch.bfloat16 if dot else torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 64, "gguf", bf16_activations=True) == rounded
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 64, "gguf") == torch.float16  # float32 activations
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", 64, "none", bf16_activations=True) == torch.float16
    assert resolve_kv_cache_dtype("float16", torch.float32, "cpu", 64, "gguf", bf16_activations=True) == torch.float16


def test_a_float32_query_over_a_bfloat16_cache_is_rounded_where_the_dot_path_runs():
    """decode_attention rounds the query to the cache's bf16 where the kernel has vdpbf16ps, so
    the result is the bf16 query's, widened; elsewhere the float32 query goes in as it is."""
    from inflight_kernels.paged_decode import decode_attention

    g = torch.Generator().manual_seed(7)
    kc = torch.randn(12, 3, 16, 64, generator=g).to(torch.bfloat16)
    vc = torch.randn(12, 3, 16, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 9, 64, generator=g)
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([5, 33, 64], dtype=torch.int32)
    got = decode_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q))
    assert got.dtype == torch.float32
    rounded = cpu_ops.paged_attention(q.bfloat16(), kc, vc, tables, lens, 0.125, torch.empty_like(q.bfloat16()))
    widened = cpu_ops.paged_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q))
    assert torch.equal(got, rounded.float() if cpu_ops.bf16_dot() else widened)


def test_auto_on_cuda_is_the_compute_dtype_and_a_mismatch_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_ops, "fast_attention", lambda: True)
    assert resolve_kv_cache_dtype("auto", torch.float32, "cuda", 64) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "cuda:0", 64) == torch.bfloat16
    with pytest.raises(ValueError, match="compute dtype"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, "cuda", 64)


def test_names_and_errors():
    assert resolve_kv_cache_dtype("fp16", torch.float32, "cpu", 64) == torch.float16
    assert resolve_kv_cache_dtype("float32", torch.bfloat16, "cpu", 64) == torch.float32
    assert resolve_kv_cache_dtype(torch.bfloat16, torch.float32, "cpu", 64) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32, "cpu", 64)


def test_a_float16_block_takes_half_the_bytes_so_a_budget_holds_twice_the_blocks():
    fp32 = KVCacheSpec(num_layers=30, num_kv_heads=3, block_size=16, head_dim=64, dtype=torch.float32)
    fp16 = KVCacheSpec(num_layers=30, num_kv_heads=3, block_size=16, head_dim=64, dtype=torch.float16)
    assert fp32.bytes_per_block == 2 * fp16.bytes_per_block == 2 * 2 * 30 * 3 * 16 * 64 * 4 // 2
    assert fp16.blocks_for_bytes(512 << 20) == 2 * fp32.blocks_for_bytes(512 << 20)


def _logits(runner) -> list[torch.Tensor]:
    """Logits of a chunked prefill of two uneven prompts, then 6 decode steps
    of both (greedy feedback from the first runner's tokens is not needed:
    fixed inputs, so both caches see the same tokens)."""
    prompts = [list(range(3, 40)), list(range(50, 61))]
    tables = [list(range(0, 8)), list(range(8, 16))]
    out = [runner.execute(ModelInput(prefills=[ScheduledChunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)]))
           .logits]
    for step in range(6):
        decodes = [ScheduledChunk(i, [7 + step + i], len(p) + step, tables[i]) for i, p in enumerate(prompts)]
        out.append(runner.execute(ModelInput(decodes=decodes)).logits)
    return out


@pytest.mark.parametrize("path", ["compiled", "padded", "varlen"])
def test_float16_cache_under_float32_compute_is_close_to_a_float32_cache(monkeypatch, path):
    if path == "compiled" and not cpu_ops.fast_attention():
        pytest.skip("the compiled CPU attention kernel is not built here")
    if path != "compiled":
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    from inflight_kernels import paged_decode

    monkeypatch.setattr(paged_decode, "VARLEN_MIN_WASTE", 1.0 if path == "varlen" else 1e9)
    reference = tiny_random_runner(seed=3, kv_cache_dtype=torch.float32)
    halved = tiny_random_runner(seed=3, kv_cache_dtype=torch.float16)
    assert halved.cache.layers[0][0].dtype == torch.float16 and halved.dtype == torch.float32
    for want, got in zip(_logits(reference), _logits(halved)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
def test_a_tokens_logits_do_not_depend_on_prefill_or_decode(kv):
    """Re-prefill (continuations, preemption by recompute) must give the
    logits decode gave: with a float16 cache the prefill attends over the
    rounded values the compiled decode kernel reads, with q and the output
    in float32 on both sides (differences are summation order only)."""
    if not cpu_ops.fast_attention():
        pytest.skip("the compiled CPU attention kernel is not built here")
    runner = tiny_random_runner(seed=5, kv_cache_dtype=kv, hidden_size=128, num_heads=2, num_kv_heads=1)
    assert runner.config.head_dim in cpu_ops.HEAD_DIMS  # the compiled kernel's path
    prompt, table = list(range(3, 45)), list(range(0, 8))
    prefilled = runner.execute(ModelInput(prefills=[ScheduledChunk(0, prompt, 0, table)])).logits[0]
    runner.execute(ModelInput(prefills=[ScheduledChunk(1, prompt[:-1], 0, table)]))
    decoded = runner.execute(ModelInput(decodes=[ScheduledChunk(1, prompt[-1:], len(prompt) - 1, table)])).logits[0]
    torch.testing.assert_close(decoded, prefilled, rtol=0, atol=1e-5 * float(prefilled.abs().max()))
