"""Weight quantization of the decoder's projections (``--quantization``).

``q8_0``: every projection and the lm_head are stored as int8 with one
float32 scale per 32 input values (llama.cpp's Q8_0 block, ggml-quants.c), and
each projection's input is rounded the same way at run time before an int8
GEMM (``kernels/cpu/q8_gemm.cpp``, oracle :func:`kernels.reference.q8_0_linear`).
Weights take a quarter of their float32 bytes, which is what a decode step on a
CPU without bfloat16 instructions mostly waits for. Measured on SmolLM2-135M
(bench/quant_accuracy.py, bench/RESULTS.md run 15), the next-token distribution
moves by a mean KL of about 0.007 nats (95% of greedy tokens unchanged under
teacher forcing); per-token activation scales instead, as W8A8 SmoothQuant-style
kernels use, moved it 11x more.

``q4_1``: the projections in llama.cpp's Q4_1 blocks (4-bit values with an fp16
scale and minimum per 32 input values, :class:`Q4Weight`,
``kernels/cpu/q4_gemm.cpp``) and the lm_head in Q8_0, the layout of the default
GGUF, whose own blocks come back unchanged when its dequantized weights are
quantized again; inputs are rounded to Q8_0 blocks as for ``q8_0``. A one-stream
step reads 97 MiB of SmolLM2-135M instead of float32's 513 (bench/RESULTS.md
run 28: mean KL 0.005 nats, top-1 0.957).

Both: CPU only, float32 compute, and only where the compiled kernels load;
``none`` (the default) keeps the float weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels

QUANTIZATIONS = ("none", "q8_0", "q4_1")
Q8_BLOCK = 32  # input values per scale


class PackedShape:
    """``shape`` for a packed weight dataclass with ``out_features`` and ``in_features``
    fields (:class:`Q8Weight`, :class:`Q4Weight`, :class:`worker.model.linear.BF16Weight`)."""

    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``, as the float weight's."""
        return self.out_features, self.in_features


@dataclass(frozen=True)
class Q8Weight(PackedShape):
    """A ``[out_features, in_features]`` weight in Q8_0, packed for the CPU kernel.

    Attributes:
        packed: int8 ``[ceil(out/8), in/32, 288]`` (tiles of 8 output columns: 256 weight
            bytes per block, then 8 int32 compensations for the VNNI kernel).
        scales: float32 ``[ceil(out/8), in/32, 8]``.
        out_features, in_features: the float weight's shape.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held: int8 values and compensations plus float32 scales."""
        return self.packed.numel() + 4 * self.scales.numel()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Q8Weight":
        """Quantize a float ``[out, in]`` weight (``in`` a multiple of 32).

        Raises:
            ValueError: ``in`` is not a multiple of 32.
            RuntimeError: the compiled CPU kernels are not available.
        """
        out_features, in_features = weight.shape
        if in_features % Q8_BLOCK:
            raise ValueError(f"q8_0 needs input widths that are multiples of {Q8_BLOCK}, got {in_features}")
        packed, scales = kernels.q8_pack_weight(weight)
        return cls(packed, scales, out_features, in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``Q8_0(x) @ Q8_0(W).T`` for ``x`` ``[rows, in]``: float32 ``[rows, out]``."""
        return kernels.q8_linear(x, self.packed, self.scales, self.out_features)


@dataclass(frozen=True)
class Q4Weight(PackedShape):
    """A ``[out_features, in_features]`` weight in llama.cpp's Q4_1 blocks (32 values:
    4-bit ``q``, fp16 scale ``d`` and minimum ``m``, ``w = d q + m``), packed for the
    CPU kernel (``kernels/cpu/q4_gemm.cpp``, oracle :func:`kernels.reference.q4_1_linear`).

    Attributes:
        packed: uint8 ``[ceil(out/8), in/32, 160]`` (tiles of 8 output columns: 128 bytes
            of 4-bit values per block, then 8 fp16 ``d``, then 8 fp16 ``m``).
        out_features, in_features: the float weight's shape.
    """

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held: 20 per column and block of 32 values (5 bits per value)."""
        return self.packed.numel()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Q4Weight":
        """Quantize a float ``[out, in]`` weight (``in`` a multiple of 32). Weights
        dequantized from Q4_1 blocks come back as the same blocks.

        Raises:
            ValueError: ``in`` is not a multiple of 32.
            RuntimeError: the compiled CPU kernels are not available.
        """
        out_features, in_features = weight.shape
        if in_features % Q8_BLOCK:
            raise ValueError(f"q4_1 needs input widths that are multiples of {Q8_BLOCK}, got {in_features}")
        return cls(kernels.q4_1_pack_weight(weight), out_features, in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``Q8_0(x) @ Q4_1(W).T`` for ``x`` ``[rows, in]``: float32 ``[rows, out]``."""
        return kernels.q4_1_linear(x, self.packed, self.out_features)


def projection_converter(quantization: str):
    """``(projections, lm_head)``: the functions turning a float ``[out, in]`` weight into
    the ``quantization``'s weights: Q8_0 for both with ``q8_0``; with ``q4_1`` Q4_1
    projections and a Q8_0 lm_head (as llama.cpp's Q4_1 files keep their output matrix
    in 8 bits, the most sensitive one: SmolLM2-135M's Q4_1 GGUF holds it in Q8_0).

    Raises:
        ValueError: ``none`` or an unknown scheme."""
    if quantization == "q8_0":
        return Q8Weight.quantize, Q8Weight.quantize
    if quantization == "q4_1":
        return Q4Weight.quantize, Q8Weight.quantize
    raise ValueError(f"no quantized weights for {quantization!r}")


def compute_dtype(quantization: str, dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype | None:
    """The compute dtype ``quantization`` imposes: None for ``none`` (``dtype``
    then resolves as usual), float32 for ``q8_0`` and ``q4_1``.

    Raises:
        ValueError: an unknown scheme; ``q8_0`` or ``q4_1`` with a dtype other than auto or
            float32, on a device other than the CPU, or without the compiled
            CPU kernels (no C++ compiler, or their smoke run failed).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in ("auto", "float32"):
        raise ValueError(f"--quantization {quantization} computes in float32; drop --dtype {name} or use float32")
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on the CPU only, not on {device}")
    if not kernels.cpu_kernels_available():
        raise ValueError(f"--quantization {quantization} needs the compiled CPU kernels, which did not load "
                         "(see the warning above; `python -m kernels.cpu.build` builds them)")
    return torch.float32
