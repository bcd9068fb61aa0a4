"""Linear layers of the decoder, with the weights prepacked for oneDNN on the CPU.

``F.linear`` hands oneDNN a plain ``[out, in]`` weight, which it re-blocks
for its AMX/AVX-512 kernels on every call. Reordering each weight once at load
time into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
the same prepacking torch.compile's CPU freezing pass does) and calling
``torch.ops.mkldnn._linear_pointwise`` skips that work: faster over a SmolLM2-135M
decode step's projections in bfloat16 on an AMX CPU (``bench/profile_step.py``;
bench/RESULTS.md, "Measurements first recorded in docstrings"), with results bit-identical
to ``F.linear`` on the shapes checked in ``tests/worker/model/test_linear.py``
(a single row is computed as two, so its bits do not depend on the batch).

On a CPU with AVX-512 BF16 and no AMX, bfloat16 weights are packed for our own kernel instead
(:class:`BF16Weight`, ``inflight_kernels/cpu/bf16_gemm.cpp``): there oneDNN's bf16 GEMM read the
weights slowly at one row and cost a fixed overhead per call (bench/RESULTS.md runs 22 and
27); ours sums every output in one fixed order, whatever the row count.

float32 is packed too: there ``F.linear`` goes to MKL's sgemm, which copies
the whole weight into its own panel layout on every call. On an AVX2-only
AMD EPYC packing made the whole fp32 decode step faster (bench/RESULTS.md, "Measurements first recorded in docstrings").
fp32 results differ from
``F.linear`` only by summation order (about 1e-6 relative). float16 and CPUs
without oneDNN bf16 kernels keep ``F.linear``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import inflight_kernels
from worker.model.dtype import cpu_has_amx
from worker.model.kquant import KQuantWeight
from worker.model.block_weights import PackedShape, Q4Weight, Q8Weight

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


@dataclass(frozen=True)
class BF16Weight(PackedShape):
    """A bfloat16 ``[out_features, in_features]`` weight packed for
    :func:`inflight_kernels.bf16_linear` (tiles of 16 output columns, input pairs
    interleaved; ``inflight_kernels/cpu/bf16_gemm.cpp``).

    Attributes:
        packed: bfloat16 ``[ceil(out/16), in/2, 32]``.
        out_features, in_features: the weight's shape.
    """

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        """bfloat16."""
        return torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Bytes held, padding columns included."""
        return self.packed.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for bfloat16 ``x`` ``[rows, in]`` (rows may be
        strided): bfloat16 ``[rows, out]``, float32 sums rounded once."""
        return inflight_kernels.bf16_linear(x, self.packed, self.out_features, bias)


def uses_bf16_kernel(dtype: torch.dtype, device: torch.device) -> bool:
    """True when :func:`pack` packs ``dtype`` weights on ``device`` for our bf16
    kernel: CPU bfloat16 with the compiled kernel (:func:`inflight_kernels.cpu_bf16_gemm`),
    on a CPU without AMX (:func:`~worker.model.dtype.cpu_has_amx`: there oneDNN
    multiplies on the AMX tiles, which one vdpbf16ps per 16 columns cannot match
    beyond a few rows)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_amx() and inflight_kernels.cpu_bf16_gemm()


def pack(weight: torch.Tensor):
    """``weight`` ``[out, in]`` packed once for the step's GEMMs: a :class:`BF16Weight`
    where :func:`uses_bf16_kernel` (and ``in`` is even), else reordered into oneDNN's
    blocked layout (an opaque ``torch._mkldnn`` tensor, same shape and dtype, no data
    pointer)."""
    if uses_bf16_kernel(weight.dtype, weight.device) and weight.shape[1] % 2 == 0:
        return BF16Weight(inflight_kernels.bf16_pack_weight(weight), weight.shape[0], weight.shape[1])
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``; ``weight`` plain, from
    :func:`pack` (``[out, in]``, oneDNN's or a :class:`BF16Weight`) or a
    :class:`~worker.model.block_weights.Q8Weight` or
    :class:`~worker.model.block_weights.Q4Weight` or :class:`~worker.model.kquant.KQuantWeight`
    (float32 ``x`` and result); returns ``[rows, out]`` in ``x.dtype``."""
    if isinstance(weight, (Q8Weight, Q4Weight, KQuantWeight)):
        out = weight(x)
        return out if bias is None else out.add_(bias)
    if isinstance(weight, BF16Weight):
        return weight(x, bias)
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
    (tests/worker/model/test_linear.py). Its cost on that machine: bench/RESULTS.md,
    "Measurements first recorded in docstrings"."""
    return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), weight, bias, "none", [], "")[:1]
