"""Dense bfloat16 copies of a GGUF file's Q4_1/Q8_0 blocks for steps of many rows
(``--dense-weights-min-rows``): making them (:func:`with_dense`; the product on them is
:class:`worker.model.block_weights.BlockWeight`'s), and the row count: checked when given, chosen from the hardware
when ``auto``, and dropped when the copies would crowd the memory. The same row count sends a
K-quant weight's products to tiles dequantized per call (:class:`worker.model.kquant.KQuantWeight`:
bfloat16 on AVX-512 BF16, ``inflight_kernels/cpu/kquant_bf16.h``; float32 on AVX2,
``kquant_f32.h``), which take no memory."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import torch

import inflight_kernels

W = TypeVar("W")  # a worker.model.block_weights.BlockWeight dataclass (gguf_formats imports both modules)

AUTO_DENSE_MIN_ROWS = 16  # --dense-weights-min-rows auto (bench/RESULTS.md runs 34 and 35: blocks win at 8)
# auto when no weight takes a copy and the K-quant tiles are the only dense products: on a 2-core
# Zen 4 the bfloat16 tiles ran a 1B Q4_K_M layer 1.3x faster than the int16 products at 8 rows, on par at 6
# (bench/RESULTS.md run 42)
# and for the float32 ones of AVX2-only CPUs: on a 2-core Zen 3 EPYC they ran the 1B file's products
# 1.16-1.23x the int16 ones at 32 rows, 0.89-1.09x at 16-24, 0.56-0.73x at 8 (bench/RESULTS.md run 43)
AUTO_KQUANT_MIN_ROWS = {"bfloat16": 8, "float32": 32}
DENSE_MEMORY_SHARE = 0.25  # auto's copies may take at most this share of the memory still available
DENSE_PACK_ROWS = 32  # the row count oneDNN tunes a dense copy's layout for (any count works)


def with_dense(weight: W, dequantized: torch.Tensor, min_rows: int) -> W:
    """``weight`` with a dense bfloat16 copy of ``dequantized`` (its float ``[out, in]`` values
    rounded to bfloat16) that its products with at least ``min_rows`` rows use instead of the
    blocks (``--dense-weights-min-rows``): on a CPU with AMX reordered for oneDNN
    (``torch.ops.mkldnn._reorder_linear_weight``; the product runs on the AMX tiles and its
    output is rounded to bfloat16 before it returns to float32), elsewhere packed for
    ``inflight_kernels/cpu/bf16_gemm.cpp`` (:func:`inflight_kernels.bf16_pack_weight`; float32 sums).

    Why: from about 16 rows a step is bound by arithmetic, not by reading the weights. The
    block products scale every 32 values by the block's own factors, which holds them to a
    fraction of the arithmetic a dense GEMM reaches; AMX multiplies 16x32 bfloat16 tiles per
    instruction: on a 2-core AMX Xeon the 32-row SmolLM2-135M step ran faster on the copies
    than on the blocks (bench/RESULTS.md run 34), while few rows keep reading the blocks'
    quarter of the bytes. Costs: 2 bytes per weight more memory (3.2x a Q4_1 weight's), the
    weights (and on oneDNN the outputs) rounded to bfloat16 in those steps (teacher-forced
    accuracy: bench/RESULTS.md runs 34 and 35), and a row's result then
    depends on how many rows share its step (``--deterministic`` refuses it).

    Raises:
        RuntimeError: no oneDNN bfloat16 kernels (AMX CPU) or no AVX-512 BF16 build
            (:func:`inflight_kernels.cpu_bf16_gemm`)."""
    return replace(weight, dense=_pack_dense(dequantized.to(torch.bfloat16).contiguous()), dense_min_rows=min_rows)


def _pack_dense(weight: torch.Tensor) -> torch.Tensor:
    from worker.model.dtype import cpu_has_amx

    if cpu_has_amx():
        return torch.ops.mkldnn._reorder_linear_weight(weight, DENSE_PACK_ROWS)
    return inflight_kernels.bf16_pack_weight(weight)


def check_dense_min_rows(dense_min_rows: int, quantization: str, bf16_activations: bool) -> None:
    """Refuse ``--dense-weights-min-rows`` where it has nothing to act on.

    Raises:
        ValueError: a negative count, or a positive one without ``gguf`` blocks that either
            path takes: copies (:func:`copies_usable`: bfloat16 activations, a CPU with AVX-512
            BF16) or K-quant tiles (:func:`inflight_kernels.cpu_kquant_tiles`: AVX-512 BF16, or
            AVX2 and FMA)."""
    if dense_min_rows < 0:
        raise ValueError(f"--dense-weights-min-rows must be 0 (off) or a row count, got {dense_min_rows}")
    if dense_min_rows and not (copies_usable(quantization, bf16_activations) or _tiles_usable(quantization, bf16_activations)):
        raise ValueError("--dense-weights-min-rows multiplies GGUF blocks in dense products (Q4_1/Q8_0 copies with "
                         "bfloat16 activations, K-quant tiles dequantized per product): it needs --quantization gguf "
                         "(or auto on a GGUF file) and a CPU with AVX-512 BF16, or AVX2 and FMA for K-quant files "
                         f"(here: quantization {quantization}, bfloat16 activations {bf16_activations}, K-quant tiles "
                         f"{inflight_kernels.cpu_kquant_tiles()})")


def resolve_dense_min_rows(dense_min_rows: int | None, quantization: str, bf16_activations: bool) -> int:
    """``--dense-weights-min-rows`` with ``auto`` (None) resolved from the hardware and the flags:
    :data:`AUTO_DENSE_MIN_ROWS` for ``gguf`` blocks with bfloat16 activations (a CPU with
    AVX-512 BF16, where ``bf16_gemm.cpp`` is built), the K-quant tiles' own
    (:func:`kquant_auto_min_rows`) for ``gguf`` on the other CPUs with tiles (AVX2 and FMA:
    they act on K-quant weights only, and no weight gets a copy there), 0 (off) elsewhere. The
    model's size and formats are checked later, once they are known (:func:`fit_dense_to_memory`).

    Why: the blocks' products spend instructions on unpacking and scaling every block, dense
    bfloat16 ones do not. On a 2-core AMX Xeon (oneDNN on the AMX tiles) and a 2-core Zen 4
    EPYC (``bf16_gemm.cpp``) the 32- and 64-row SmolLM2-135M steps ran faster on the copies
    (bench/RESULTS.md runs 34 and 35); at 8 rows the blocks, a quarter of the bytes, still
    win on both.

    Raises:
        ValueError: as :func:`check_dense_min_rows` for an explicit count."""
    if dense_min_rows is None:
        if copies_usable(quantization, bf16_activations):
            return AUTO_DENSE_MIN_ROWS
        return kquant_auto_min_rows() if _tiles_usable(quantization, bf16_activations) else 0
    check_dense_min_rows(dense_min_rows, quantization, bf16_activations)
    return dense_min_rows


def dense_copy_bytes(config) -> int:
    """Bytes of the dense bfloat16 copies of a model's projections and lm_head at 2 bytes per
    weight (an upper bound: only weights held in Q4_1/Q8_0 blocks get one, which
    :func:`worker.model.gguf_formats.copied_bytes` counts from the file's formats). ``config``: a
    :class:`worker.model.model_config.ModelConfig`."""
    return 2 * (config.num_layers * sum(projection_sizes(config).values()) + config.vocab_size * config.hidden_size)


def projection_sizes(config) -> dict[str, int]:
    """Weights of each fused projection of one decoder layer (``qkv``, ``o``, ``gate_up``, ``down``)."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    return {"qkv": hidden * head_dim * (config.num_heads + 2 * config.num_kv_heads),
            "o": hidden * head_dim * config.num_heads, "gate_up": 2 * hidden * inter, "down": hidden * inter}


def fit_dense_to_memory(dense_min_rows: int, copy_bytes: int, available: int | None) -> int:
    """``auto``'s row count, or 0 when the copies (``copy_bytes``) would take more than
    :data:`DENSE_MEMORY_SHARE` of the ``available`` bytes (:func:`worker.model.host_memory.available_bytes`
    after the weights are loaded, while their float32 staging copy is still held, so the rule errs
    on the safe side; the KV cache is allocated after; None: unknown, kept). SmolLM2-135M's copies are 269 MB; a 7B
    model's would be about 14 GB, more than its Q4_1 blocks' 4 GB, and would crowd out the KV
    cache. An explicit ``--dense-weights-min-rows`` is not checked."""
    if dense_min_rows and available is not None and copy_bytes > DENSE_MEMORY_SHARE * available:
        return 0
    return dense_min_rows


def kquant_auto_min_rows() -> int:
    """``auto``'s row count for K-quant weights when no weight takes a copy: the crossover of
    the build's tiles (:data:`AUTO_KQUANT_MIN_ROWS`), 0 where it has none."""
    return AUTO_KQUANT_MIN_ROWS.get(inflight_kernels.cpu_kquant_tiles() or "", 0)


def copies_usable(quantization: str, bf16_activations: bool) -> bool:
    """Whether Q4_1/Q8_0 blocks can take dense bfloat16 copies (:func:`with_dense`): ``gguf``
    with bfloat16 activations and the AVX-512 BF16 GEMM built."""
    return quantization == "gguf" and bf16_activations and inflight_kernels.cpu_bf16_gemm()


def _tiles_usable(quantization: str, bf16_activations: bool) -> bool:
    """K-quant tiles for ``gguf``: float32 ones always, bfloat16 ones with bfloat16 activations
    (``--dtype float32`` keeps them off, as it keeps the copies)."""
    tiles = inflight_kernels.cpu_kquant_tiles()
    return quantization == "gguf" and (tiles == "float32" or tiles == "bfloat16" and bf16_activations)
