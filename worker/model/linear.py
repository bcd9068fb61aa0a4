"""Linear layers of the decoder, with the weights prepacked for oneDNN on the CPU.

``F.linear`` hands oneDNN a plain ``[out, in]`` weight, which it re-blocks
for its AMX/AVX-512 kernels on every call. Reordering each weight once at load
time into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
the same prepacking torch.compile's CPU freezing pass does) and calling
``torch.ops.mkldnn._linear_pointwise`` skips that work: measured 1.3-1.7x
faster over a SmolLM2-135M decode step's projections at batch 4-64 in
bfloat16 on an AMX CPU (``bench/profile_step.py``), with results bit-identical
to ``F.linear`` on the shapes checked in ``tests/worker/model/test_linear.py``
(a single row is computed as two, so its bits do not depend on the batch).

float32 is packed too: there ``F.linear`` goes to MKL's sgemm, which copies
the whole weight into its own panel layout on every call. On an AVX2-only
AMD EPYC (2 vCPUs) packing made the whole fp32 decode step 1.3-2.0x faster at
batch 8-64 (the lm_head alone 2.2x at 32 rows). fp32 results differ from
``F.linear`` only by summation order (about 1e-6 relative). float16 and CPUs
without oneDNN bf16 kernels keep ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from worker.model.quantization import Q8Weight

log = logging.getLogger(__name__)
PACK_BATCH_HINT = 32  # rows oneDNN tunes the blocked layout for; any row count works


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """True when weights of ``dtype`` on ``device`` are packed: CPU float32,
    or CPU bfloat16 with oneDNN bf16 support, with oneDNN and the packing ops
    present in this torch."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout (an
    opaque ``torch._mkldnn`` tensor, same shape and dtype, no data pointer)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``; ``weight`` plain, from
    :func:`pack` (``[out, in]``) or a :class:`~worker.model.quantization.Q8Weight`
    (float32 ``x`` and result); returns ``[rows, out]`` in ``x.dtype``."""
    if isinstance(weight, Q8Weight):
        out = weight(x)
        return out if bias is None else out.add_(bias)
    if weight.layout == torch._mkldnn:
        if x.shape[0] == 1:  # oneDNN's one-row kernel sums in another order: see _one_row
            return _one_row(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A packed projection of one row ``x`` [1, in], computed as the first row of a
    two-row product. oneDNN runs a single row through another kernel than two or more,
    with another summation order: on an AVX-512 BF16 Xeon a request decoding alone got
    different logits than the same request batched (bfloat16: 0.375 on one logit after
    30 layers; the down projection, K = 1536, was the first op to differ), so greedy and
    seeded text depended on what else was running. Rows 2..40 agree bit for bit
    (tests/worker/model/test_linear.py). Costs about 1.2 ms of a 28 ms bfloat16
    batch-1 step on that machine, 0.3 ms in float32."""
    return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), weight, bias, "none", [], "")[:1]
