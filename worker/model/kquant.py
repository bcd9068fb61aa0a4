"""Weights kept in a GGUF file's own K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).

A ``Q4_K_M`` file, the one users download, holds most projections in Q4_K (4.5 bits per
weight) and some in Q6_K (6.5). Dequantizing them at load to bfloat16 makes a decode
step read 3.3x the bytes llama.cpp reads, and to float32 6.6x (issue 48; the one-stream
speed that cost and this module's since: bench/RESULTS.md run 36). :class:`KQuantWeight` keeps the bytes as the
file stores them, usually as views of the file's memory map, so the worker's resident memory
follows the file's size, and multiplies them with
:func:`inflight_kernels.kquant_linear` (``inflight_kernels/cpu/kquant_gemm.cpp``), which
unpacks each row of blocks in registers and cache.

A fused projection (q/k/v, gate/up) is the list of its parts, each with its own type
(``Q4_K_M`` mixes Q4_K q/k with Q6_K v in some layers), written into column slices of one
output: nothing is concatenated or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import inflight_kernels
from worker.model.block_weights import PackedShape

# ggml's type ids by lower-case name (gguf's GGMLQuantizationType, ggml.h enum ggml_type)
KQUANT_TYPES = {name: int(GGMLQuantizationType[name.upper()]) for name in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")}
KQUANT_BLOCK = 256  # values per super-block


@dataclass(frozen=True)
class KQuantPart:
    """One GGUF tensor's rows in its K-quant blocks.

    Attributes:
        blocks: uint8 ``[rows, in_features / 256 * block bytes]`` with contiguous rows (a view
            of the file's memory map, or a copy when its rows were reordered).
        ggml_type: ggml's type id (10..14: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).
    """

    blocks: torch.Tensor
    ggml_type: int

    @property
    def rows(self) -> int:
        """Output features of this part."""
        return self.blocks.shape[0]


@dataclass(frozen=True)
class KQuantWeight(PackedShape):
    """A ``[out_features, in_features]`` weight held in K-quant blocks, the row-wise
    concatenation of ``parts``; float32 in and out.

    Attributes:
        parts: the GGUF tensors whose rows make up the weight, in output order.
        out_features, in_features: the float weight's shape.
        dense_min_rows: products of at least this many rows dequantize the blocks into bfloat16
            tiles in cache and multiply bfloat16-rounded activations (``--dense-weights-min-rows``;
            :func:`inflight_kernels.kquant_linear`); 0: always the int16 products.
    """

    parts: tuple[KQuantPart, ...]
    out_features: int
    in_features: int
    dense_min_rows: int = 0

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, kind: str, in_features: int) -> "KQuantWeight":
        """One GGUF tensor (``blocks`` uint8 ``[out, in / 256 * block bytes]``, ``kind`` its
        lower-case type name, e.g. ``"q4_k"``) of ``in_features`` inputs.

        Raises:
            ValueError: not a K-quant type, or the byte count does not match ``in_features``."""
        if kind not in KQUANT_TYPES:
            raise ValueError(f"{kind!r} is not a K-quant type ({', '.join(KQUANT_TYPES)})")
        ggml_type = KQUANT_TYPES[kind]
        expected = in_features // KQUANT_BLOCK * GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]
        if in_features % KQUANT_BLOCK or blocks.dim() != 2 or blocks.shape[1] != expected:
            raise ValueError(f"{kind} blocks of shape {tuple(blocks.shape)} do not hold rows of {in_features} values "
                             f"({expected} bytes each)")
        return cls((KQuantPart(blocks, ggml_type),), blocks.shape[0], in_features)

    @classmethod
    def cat(cls, weights: list["KQuantWeight"]) -> "KQuantWeight":
        """The row-wise concatenation of ``weights`` (a fused projection), sharing their blocks.

        Raises:
            ValueError: their input widths differ."""
        widths = {w.in_features for w in weights}
        if len(widths) != 1:
            raise ValueError(f"cannot fuse K-quant weights of input widths {sorted(widths)}")
        return cls(tuple(p for w in weights for p in w.parts), sum(w.out_features for w in weights), widths.pop())

    def permute_rows(self, order: torch.Tensor) -> "KQuantWeight":
        """The weight with its rows taken in ``order`` (int64 ``[out]``; a copy of the blocks:
        llama.cpp's q/k row order for its interleaved RoPE undone). Single-part weights only.

        Raises:
            ValueError: a fused weight."""
        if len(self.parts) != 1:
            raise ValueError("permute_rows takes a single GGUF tensor")
        part = self.parts[0]
        return KQuantWeight((KQuantPart(part.blocks.index_select(0, order).contiguous(), part.ggml_type),),
                            self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        """float32: the dtype of the products' inputs and outputs (and of :meth:`lookup`)."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        """The CPU."""
        return torch.device("cpu")

    @property
    def block_nbytes(self) -> int:
        """Bytes of the blocks, which every product reads."""
        return sum(p.blocks.numel() for p in self.parts)

    nbytes = block_nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: float32 ``[rows, out]``
        (:func:`inflight_kernels.kquant_linear`, through bfloat16 tiles from ``dense_min_rows`` rows)."""
        return inflight_kernels.kquant_linear(x, [p.blocks for p in self.parts], [p.ggml_type for p in self.parts],
                                              dense_min_rows=self.dense_min_rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int ``[n]``) dequantized: float32 ``[n, in]`` (the token embedding).

        Raises:
            ValueError: a fused weight; RuntimeError / IndexError: an id out of range."""
        if len(self.parts) != 1:
            raise ValueError("lookup takes a single GGUF tensor")
        part = self.parts[0]
        return inflight_kernels.kquant_dequantize_rows(part.blocks, part.ggml_type, ids)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 ``[out, in]`` (for paths that need float weights)."""
        from inflight_kernels.reference import kquant_dequantize_rows

        return torch.cat([kquant_dequantize_rows(p.blocks, p.ggml_type) for p in self.parts])
