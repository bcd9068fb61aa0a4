"""The smoke self-test of a fresh CPU-kernel build: every compiled op once on a
tiny random case against :mod:`inflight_kernels.reference`.

:func:`inflight_kernels.cpu.build.load` runs :func:`run` in a child process before the
first load of a build (an illegal instruction kills only the child), so this
module works on the raw extension (:func:`inflight_kernels.cpu.build.build_module`), not
through :func:`inflight_kernels.cpu.build.load` or :mod:`inflight_kernels.cpu.ops`.
``python -m inflight_kernels.cpu.selftest`` runs it by hand: exit status 0 when every op
agrees, :data:`inflight_kernels.cpu.build.SMOKE_MISMATCH_EXIT` when one does not.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from inflight_kernels import reference
from inflight_kernels.cpu import build


def run() -> bool:
    """Build (or find) the extension and check every compiled op once against
    the reference: three pages (16-row tiles and a partial page, so the vector
    tile reduction, exp and softmax loops all run), each dtype; then the
    float32-query instantiation, the Q8_0 GEMM and the sampler. True when all agree.

    Raises:
        Exception: the build failed (see :func:`inflight_kernels.cpu.build.build_module`).
    """
    module = build.build_module(build.build_dir())
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        q = torch.randn(2, 6, 64, generator=g).to(dtype)
        kc, vc = (torch.randn(4, 2, 16, 64, generator=g).to(dtype) for _ in range(2))
        tables = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
        lens = torch.tensor([40, 33], dtype=torch.int32)
        out = torch.empty_like(q)
        module.paged_attention_decode(out, q, kc, vc, tables, lens, 0.125)
        ref = reference.paged_attention(q.float(), kc.float(), vc.float(), tables, lens, 0.125)
        x, w = torch.randn(3, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
        normed = torch.empty_like(x)
        module.rms_norm(normed, x, w, 1e-5)
        gate_up = torch.randn(3, 128, generator=g).to(dtype)
        act = torch.empty(3, 64, dtype=dtype)
        module.silu_mul(act, gate_up)
        if not (torch.allclose(out.float(), ref, atol=tol, rtol=tol)
                and torch.allclose(normed.float(), reference.rms_norm(x, w, 1e-5).float(), atol=tol, rtol=tol)
                and torch.allclose(act.float(), reference.silu_mul(gate_up).float(), atol=tol, rtol=tol)):
            return False
    return _float32_query(module, g) and _q8(module, g) and _sampler(module, g)


def _float32_query(module: ModuleType, g: torch.Generator) -> bool:
    """The float32-query-over-float16-cache instantiation (``--kv-cache-dtype
    auto`` under float32 compute) against the oracle on the widened cache."""
    q = torch.randn(2, 6, 64, generator=g)
    kc, vc = (torch.randn(4, 2, 16, 64, generator=g).half() for _ in range(2))
    tables = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    out = torch.empty_like(q)
    module.paged_attention_decode(out, q, kc, vc, tables, lens, 0.125)
    ref = reference.paged_attention(q, kc.float(), vc.float(), tables, lens, 0.125)
    return torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def _q8(module: ModuleType, g: torch.Generator) -> bool:
    """The Q8_0 GEMM (a partial column tile and a partial row group) against its oracle."""
    x, w = torch.randn(6, 64, generator=g), torch.randn(13, 64, generator=g)
    packed, scales = module.q8_pack_weight(w)
    out = torch.empty(6, 13)
    module.q8_linear(out, x, packed, scales)
    return torch.allclose(out, reference.q8_0_linear(x, w), atol=1e-4, rtol=1e-4)


def _sampler(module: ModuleType, g: torch.Generator) -> bool:
    """The sampler's three paths (top-k, top-p, whole vocabulary) on rows of 40
    (vector loops and tails) where the token is known: top_k=1 and a tiny top_p
    give the argmax, u=0 over the whole vocabulary its first token."""
    logits = torch.randn(3, 40, generator=g)
    out = torch.empty(3, dtype=torch.int64)
    module.sample_tokens(out, logits, torch.arange(3), torch.ones(3), torch.zeros(3, dtype=torch.float64),
                         torch.tensor([1, 0, 0]), torch.tensor([1.0, 1e-6, 1.0]), torch.tensor([0.5, 0.5, 0.0]))
    return out.tolist() == [int(logits[0].argmax()), int(logits[1].argmax()), 0]


if __name__ == "__main__":
    sys.exit(0 if run() else build.SMOKE_MISMATCH_EXIT)
