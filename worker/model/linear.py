"""Linear layers of the decoder, with the weights prepacked for oneDNN on the CPU.

``F.linear`` hands oneDNN a plain ``[out, in]`` weight, which it re-blocks
for its AMX/AVX-512 kernels on every call. Reordering each weight once at load
time into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
the same prepacking torch.compile's CPU freezing pass does) and calling
``torch.ops.mkldnn._linear_pointwise`` skips that work: measured 1.3-1.7x
faster over a SmolLM2-135M decode step's projections at batch 4-64 in
bfloat16 on an AMX CPU (``bench/profile_step.py``), with results bit-identical
to ``F.linear`` on the shapes checked in ``tests/worker/model/test_linear.py``.
Only bfloat16 on CPUs where oneDNN has bf16 kernels is packed; float32 keeps
``F.linear`` (the reference numerics of the tests).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
PACK_BATCH_HINT = 32  # rows oneDNN tunes the blocked layout for; any row count works


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """True when weights of ``dtype`` on ``device`` are packed: CPU bfloat16
    with oneDNN bf16 support and the packing ops present in this torch."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout (an
    opaque ``torch._mkldnn`` tensor, same shape and dtype, no data pointer)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``; ``weight`` plain or
    from :func:`pack` (``[out, in]``); returns ``[rows, out]`` in ``x.dtype``."""
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
