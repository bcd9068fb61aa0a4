"""With CuPy unimportable, the kernel package, the worker's model path and the
torch reference ops still work, and the CUDA path fails with clear errors.

Runs in a subprocess with ``sys.modules["cupy"] = None`` (import raises
ImportError), so an installed CuPy cannot mask a stray top-level import.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib, sys
    sys.modules["cupy"] = None
    import torch
    import inflight_kernels, inflight_kernels.dispatch, inflight_kernels.reference, inflight_kernels.cuda.ops, inflight_kernels.cuda.build, inflight_kernels.cuda.launch
    for name in ("worker.model.attention", "worker.model.model_runner"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a missing dependency, not a missing module: fail
                raise
    # reference path through the public dispatch
    torch.manual_seed(0)
    kc = torch.zeros(4, 2, 8, 64); vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64); v = torch.randn(3, 2, 64)
    inflight_kernels.reshape_and_cache(k, v, kc, vc, torch.tensor([0, -1, 9]))
    assert torch.equal(kc[0, :, 0], k[0]) and torch.equal(vc[1, :, 1], v[2]) and kc[0, :, 1].abs().sum() == 0
    q = torch.randn(2, 4, 64)
    out = inflight_kernels.paged_attention(q, kc, vc, torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                                  torch.tensor([10, 1], dtype=torch.int32), 0.125)
    assert out.shape == q.shape and torch.isfinite(out).all()
    # CUDA path: validation before any CuPy import, then a clear ImportError
    try:
        inflight_kernels.cuda.ops.paged_attention(q, kc, vc, torch.zeros(2, 2, dtype=torch.int32),
                                         torch.ones(2, dtype=torch.int32), 0.125)
    except ValueError as exc:
        assert "CUDA" in str(exc), exc
    else:
        raise AssertionError("CPU tensors accepted by cuda_ops")
    try:
        inflight_kernels.cuda.build.get_module("paged_attention", "float16", 128, 16, 0)
    except ImportError as exc:
        assert "CuPy" in str(exc), exc
    else:
        raise AssertionError("get_module worked without CuPy")
    assert "cupy" not in [m for m in sys.modules if sys.modules[m] is not None]
    print("OK")
    """
)


def test_kernels_and_worker_import_without_cupy():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
