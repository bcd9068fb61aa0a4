"""Projection weights held in llama.cpp's 32-value blocks for the compiled CPU kernels:
:class:`Q8Weight` (Q8_0) and :class:`Q4Weight` (Q4_1), on the shared :class:`BlockWeight`
(the product, with an optional dense bfloat16 copy for steps of many rows:
:func:`worker.model.dense_weights.with_dense`). Which scheme a model takes is
:mod:`worker.model.quantization`'s; which tensors keep a GGUF file's blocks,
:mod:`worker.model.gguf_formats`'."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import inflight_kernels

Q8_BLOCK = 32  # input values per scale


class PackedShape:
    """``shape`` for a packed weight dataclass with ``out_features`` and ``in_features``
    fields (:class:`Q8Weight`, :class:`Q4Weight`, :class:`worker.model.linear.BF16Weight`,
    :class:`worker.model.kquant.KQuantWeight`)."""

    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``, as the float weight's."""
        return self.out_features, self.in_features


class BlockWeight(PackedShape):
    """What :class:`Q8Weight` and :class:`Q4Weight` share: a ``[out, in]`` weight in blocks of
    32 input values whose product runs on the blocks (:meth:`blocks_linear`, each class's
    kernel) or, for steps of at least ``dense_min_rows`` rows, on a dense bfloat16 copy
    ``dense`` (:func:`worker.model.dense_weights.with_dense`). Subclasses are frozen
    dataclasses with the fields ``out_features``, ``in_features``, ``dense`` and
    ``dense_min_rows`` and the property ``block_nbytes``."""

    dense: torch.Tensor | None
    dense_min_rows: int

    @staticmethod
    def check_width(scheme: str, in_features: int) -> None:
        """Raise ValueError unless ``in_features`` is a whole number of 32-value blocks."""
        if in_features % Q8_BLOCK:
            raise ValueError(f"{scheme} needs input widths that are multiples of {Q8_BLOCK}, got {in_features}")

    @property
    def block_nbytes(self) -> int:  # pragma: no cover - each subclass's
        """Bytes of the blocks, which a product of fewer than ``dense_min_rows`` rows reads."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks and the dense copy (2 per weight)."""
        return self.block_nbytes + (0 if self.dense is None else 2 * self.out_features * self.in_features)

    def blocks_linear(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - each subclass's
        """The product on the blocks: float32 ``[rows, out]`` for ``x`` ``[rows, in]``."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: float32 ``[rows, out]``, from the dense copy at
        ``dense_min_rows`` rows or more, else from the blocks (:meth:`blocks_linear`)."""
        if self.dense is not None and x.shape[0] >= self.dense_min_rows:
            return self._dense_linear(x)
        return self.blocks_linear(x)

    def _dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the dense copy, ``x`` rounded to bfloat16: float32 ``[rows, out]``."""
        if self.dense.layout == torch._mkldnn:  # as decode_stack.cpp's onednn_linear
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.dense, None, "none", [], "").float()
        return inflight_kernels.bf16_linear(x.to(torch.bfloat16), self.dense, self.out_features,
                                            out_dtype=torch.float32)


@dataclass(frozen=True)
class Q8Weight(BlockWeight):
    """A ``[out_features, in_features]`` weight in Q8_0, packed for the CPU kernel.

    Attributes:
        packed: int8 ``[ceil(out/8), in/32, 288]`` (tiles of 8 output columns: 256 weight
            bytes per block, then 8 int32 compensations for the VNNI kernel).
        scales: float32 ``[ceil(out/8), in/32, 8]``.
        out_features, in_features: the float weight's shape.
        float_activations: multiply float32 inputs by the dequantized weight
            (:func:`inflight_kernels.q8_0_dequant_linear`, weight-only) instead of rounding
            them to Q8_0 blocks first (:func:`inflight_kernels.q8_linear`).
        bf16_activations: with ``float_activations``, round the inputs to bfloat16 for
            the products (``vdpbf16ps``, :func:`inflight_kernels.cpu_dequant_bf16`); the weights
            stay exact and the output float32.
        dense, dense_min_rows: see :func:`worker.model.dense_weights.with_dense`.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    float_activations: bool = False
    bf16_activations: bool = False
    dense: torch.Tensor | None = None
    dense_min_rows: int = 0

    @property
    def block_nbytes(self) -> int:
        """Bytes of the blocks, which a product of fewer than ``dense_min_rows`` rows reads:
        int8 values and compensations plus float32 scales."""
        return self.packed.numel() + 4 * self.scales.numel()

    @classmethod
    def quantize(cls, weight: torch.Tensor, float_activations: bool = False,
                 bf16_activations: bool = False) -> "Q8Weight":
        """Quantize a float ``[out, in]`` weight (``in`` a multiple of 32). Weights
        dequantized from Q8_0 blocks come back as the same int8 values (the scales
        within a float32 rounding of the file's fp16 ones).

        Raises:
            ValueError: ``in`` is not a multiple of 32.
            RuntimeError: the compiled CPU kernels are not available.
        """
        out_features, in_features = weight.shape
        cls.check_width("q8_0", in_features)
        packed, scales = inflight_kernels.q8_pack_weight(weight)
        return cls(packed, scales, out_features, in_features, float_activations,
                   float_activations and bf16_activations)

    def blocks_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``Q8_0(x) @ Q8_0(W).T`` (``x @ Q8_0(W).T`` with ``float_activations``) for
        ``x`` ``[rows, in]``: float32 ``[rows, out]``."""
        if self.float_activations:
            return inflight_kernels.q8_0_dequant_linear(x, self.packed, self.scales, self.out_features,
                                               self.bf16_activations)
        return inflight_kernels.q8_linear(x, self.packed, self.scales, self.out_features)


@dataclass(frozen=True)
class Q4Weight(BlockWeight):
    """A ``[out_features, in_features]`` weight in llama.cpp's Q4_1 blocks (32 values:
    4-bit ``q``, fp16 scale ``d`` and minimum ``m``, ``w = d q + m``), packed for the
    CPU kernel (``inflight_kernels/cpu/q4_gemm.cpp``, oracle :func:`inflight_kernels.reference.q4_1_linear`).

    Attributes:
        packed: uint8 ``[ceil(out/8), in/32, 160]`` (tiles of 8 output columns: 128 bytes
            of 4-bit values per block, then 8 fp16 ``d``, then 8 fp16 ``m``).
        out_features, in_features: the float weight's shape.
        float_activations: multiply float32 inputs by the dequantized weight
            (:func:`inflight_kernels.q4_1_dequant_linear`, weight-only) instead of rounding
            them to Q8_0 blocks first (:func:`inflight_kernels.q4_1_linear`).
        bf16_activations: with ``float_activations``, round the inputs to bfloat16 for
            the products (``vdpbf16ps``, :func:`inflight_kernels.cpu_dequant_bf16`); the weights
            stay exact and the output float32.
        dense, dense_min_rows: see :func:`worker.model.dense_weights.with_dense`.
    """

    packed: torch.Tensor
    out_features: int
    in_features: int
    float_activations: bool = False
    bf16_activations: bool = False
    dense: torch.Tensor | None = None
    dense_min_rows: int = 0

    @property
    def block_nbytes(self) -> int:
        """Bytes of the blocks, which a product of fewer than ``dense_min_rows`` rows reads:
        20 per column and block of 32 values (5 bits per value)."""
        return self.packed.numel()

    @classmethod
    def quantize(cls, weight: torch.Tensor, float_activations: bool = False,
                 bf16_activations: bool = False) -> "Q4Weight":
        """Quantize a float ``[out, in]`` weight (``in`` a multiple of 32). Weights
        dequantized from Q4_1 blocks come back as the same blocks.

        Raises:
            ValueError: ``in`` is not a multiple of 32.
            RuntimeError: the compiled CPU kernels are not available.
        """
        out_features, in_features = weight.shape
        cls.check_width("q4_1", in_features)
        return cls(inflight_kernels.q4_1_pack_weight(weight), out_features, in_features, float_activations,
                   float_activations and bf16_activations)

    def blocks_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``Q8_0(x) @ Q4_1(W).T`` (``x @ Q4_1(W).T`` with ``float_activations``) for
        ``x`` ``[rows, in]``: float32 ``[rows, out]``."""
        if self.float_activations:
            return inflight_kernels.q4_1_dequant_linear(x, self.packed, self.out_features, self.bf16_activations)
        return inflight_kernels.q4_1_linear(x, self.packed, self.out_features)
