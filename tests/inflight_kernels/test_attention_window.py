"""Sliding-window and soft-capped decode attention (Mistral, Gemma 2/3): the torch
reference against a direct softmax over the window, and the compiled CPU kernel
against the reference, including pages before the window that hold garbage (freed
blocks) and windows that start inside a page."""

import os

import pytest
import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build as cpu_build
from inflight_kernels.cpu import ops as cpu_ops

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _case(dtype, lens, *, heads=8, kv_heads=2, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size) + 1
    num_blocks = len(lens) * max_blocks + 2
    kc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _direct(q, kc, vc, tables, lens, scale, window, cap):
    """Per sequence and head: softmax over the last ``window`` keys, written out plainly."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    bs, group = kc.shape[2], q.shape[1] // kc.shape[1]
    for s, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks = tables[s].long()[pos // bs]
        for h in range(q.shape[1]):
            keys = kc[blocks, h // group, pos % bs].float()
            values = vc[blocks, h // group, pos % bs].float()
            x = keys @ q[s, h].float() * scale
            if cap:
                x = cap * torch.tanh(x / cap)
            out[s, h] = torch.softmax(x, 0) @ values
    return out


@pytest.mark.parametrize("window,cap", [(5, None), (16, None), (21, 50.0), (None, 3.0), (1, None), (400, 2.0)])
def test_reference_matches_a_direct_softmax_over_the_window(window, cap):
    q, kc, vc, tables, lens = _case(torch.float32, [1, 5, 16, 17, 40, 100], seed=window or 7)
    out = reference.paged_attention(q, kc, vc, tables, lens, 0.125, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(out, _direct(q, kc, vc, tables, lens, 0.125, window, cap), rtol=1e-5, atol=1e-5)


def test_reference_without_window_or_cap_is_unchanged():
    case = _case(torch.float32, [3, 30, 70])
    torch.testing.assert_close(reference.paged_attention(*case, 0.1),
                               reference.paged_attention(*case, 0.1, sliding_window=0, logits_soft_cap=0.0))


@pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,cap", [(5, None), (16, None), (21, 50.0), (None, 3.0), (33, 1.5)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (128, 4, 4), (256, 4, 1)])
def test_compiled_kernel_matches_reference(dtype, window, cap, head_dim, heads, kv_heads):
    assert cpu_ops.available(), "the CPU kernels did not build"
    q, kc, vc, tables, lens = _case(dtype, [1, 5, 16, 17, 40, 100], heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, seed=head_dim)
    if window:  # pages wholly before each window are freed: point them outside the cache
        for s, n in enumerate(lens.tolist()):
            tables[s, : max(0, n - window) // kc.shape[2]] = 10**6
    out = cpu_ops.paged_attention(q, kc, vc, tables, lens, head_dim**-0.5, torch.full_like(q, float("nan")),
                                  sliding_window=window, logits_soft_cap=cap)
    safe = tables.clamp(max=kc.shape[0] - 1)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), safe, lens, head_dim**-0.5,
                                    sliding_window=window, logits_soft_cap=cap)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype]), (out.float() - ref).abs().max()


@pytest.mark.skipif(os.environ.get(cpu_build.ENV_SWITCH) == "0", reason="CPU kernels switched off")
def test_compiled_kernel_still_checks_the_blocks_inside_the_window():
    q, kc, vc, tables, lens = _case(torch.float32, [40])
    tables[0, 2] = 10**6  # tokens 32..39: inside a 10-token window
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.paged_attention(q, kc, vc, tables, lens, 0.1, sliding_window=10)
