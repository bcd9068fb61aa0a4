"""Weight quantization of the decoder's projections (``--quantization``).

``q8_0``: every projection and the lm_head are stored as int8 with one
float32 scale per 32 input values (llama.cpp's Q8_0 block, ggml-quants.c), and
each projection's input is rounded the same way at run time before an int8
GEMM (``inflight_kernels/cpu/q8_gemm.cpp``, oracle :func:`inflight_kernels.reference.q8_0_linear`).
Weights take a quarter of their float32 bytes, which is what a decode step on a
CPU without bfloat16 instructions mostly waits for. On SmolLM2-135M the next-token
distribution moves measurably (bench/quant_accuracy.py; bench/RESULTS.md run 15, and today's
figures in its first table); per-token activation scales instead, as W8A8
SmoothQuant-style kernels use, moved it far more (run 15).

``q4_1``: the projections in llama.cpp's Q4_1 blocks (4-bit values with an fp16
scale and minimum per 32 input values, :class:`~worker.model.block_weights.Q4Weight`,
``inflight_kernels/cpu/q4_gemm.cpp``) and the lm_head in Q8_0, the layout of the default
GGUF, whose own blocks come back unchanged when its dequantized weights are
quantized again; inputs are rounded to Q8_0 blocks as for ``q8_0``. A one-stream
step reads 97 MiB of SmolLM2-135M instead of float32's 513 (its speed and accuracy:
bench/RESULTS.md run 28).

``gguf``: weight-only, for GGUF files: every projection (and the lm_head) whose
tensors the file holds in Q4_1 or in Q8_0 blocks keeps those blocks
(:class:`~worker.model.block_weights.Q4Weight`, :class:`~worker.model.block_weights.Q8Weight`
with ``float_activations``; which ones: :mod:`worker.model.gguf_formats`), and the activations stay float32: the
weights are dequantized in registers as they stream past
(``inflight_kernels/cpu/dequant_gemm.cpp``), so a step reads the file's own bytes while the
arithmetic is that of the dequantized float32 model. Tensors in K-quant blocks (Q2_K..Q6_K,
the ``Q*_K_M`` files) stay in the file's own blocks, memory-mapped
(:class:`worker.model.kquant.KQuantWeight`, ``inflight_kernels/cpu/kquant_gemm.cpp``: int16
activations per 32 values), the embedding included. Weights of other types (F16, Q4_0,
Q5_0, Q5_1) are dequantized to float32 as with ``none``. vLLM's ``--quantization gguf``
likewise runs a GGUF file's own blocks with unquantized activations.

With ``--dtype auto`` on CPUs with native bfloat16 math (AVX-512 BF16 or AMX), or with
``--dtype bfloat16``, the Q4_1 and Q8_0 products round their activations to bfloat16 and run on
``vdpbf16ps`` (:func:`gguf_bf16_activations`, ``inflight_kernels/cpu/dequant_gemm_bf16.cpp``),
as vLLM's GGUF kernels multiply in the activations' 16-bit dtype; the weights stay exact
and everything else float32. ``--dtype float32`` keeps every product in float32.

``auto`` (the default): ``gguf`` for a GGUF file whose projections are all Q4_1, Q8_0 or
K-quants, on the CPU (``--dtype auto``, ``float32``, or ``bfloat16`` where the CPU has
AVX-512 BF16) where the compiled kernels load, else ``none`` (:func:`resolve_quantization`).

All but ``none``: CPU only, float32 compute, and only where the compiled kernels load;
``none`` keeps the float weights.

This file chooses and checks the scheme; the block weights are in
:mod:`worker.model.block_weights`, their dense copies in :mod:`worker.model.dense_weights`.
"""

from __future__ import annotations

import torch

import inflight_kernels
from worker.model.gguf_formats import GGUF_BLOCK_FORMATS, KQUANT_FORMATS

QUANTIZATIONS = ("none", "q8_0", "q4_1", "gguf")


def resolve_quantization(quantization: str, model_path, dtype: str | torch.dtype, device: str | torch.device) -> str:
    """``quantization`` with ``auto`` resolved: ``gguf`` for a ``.gguf`` file whose projections
    are all in :data:`~worker.model.gguf_formats.GGUF_BLOCK_FORMATS` or :data:`~worker.model.gguf_formats.KQUANT_FORMATS` (read from its header), on the CPU when ``dtype`` is
    auto or float32 (or bfloat16 where :func:`gguf_bf16_activations` can honour it) and the
    compiled CPU kernels load; ``none`` otherwise (dequantized weights). A choice made from the hardware and the file only (never from
    timings), so identical workers compute identically.

    Raises:
        ValueError: ``gguf`` asked for a model that is not a ``.gguf`` file; see
            :func:`worker.model.gguf_loader.gguf_tensor_formats` for an unreadable header."""
    is_gguf = str(model_path).endswith(".gguf")
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"--quantization gguf keeps a GGUF file's blocks; {model_path} is not a .gguf file")
    if quantization != "auto":
        return quantization
    name = str(dtype).removeprefix("torch.")
    dtype_ok = name in ("auto", "float32") or (name == "bfloat16" and inflight_kernels.cpu_dequant_bf16())
    usable = (is_gguf and torch.device(device).type == "cpu" and dtype_ok
              and inflight_kernels.cpu_kernels_available() and _all_projections_kept(model_path))
    return "gguf" if usable else "none"


def gguf_bf16_activations(dtype: str | torch.dtype) -> bool:
    """Whether ``gguf``'s Q4_1 and Q8_0 products round their activations to bfloat16
    (``inflight_kernels/cpu/dequant_gemm_bf16.cpp``) for the worker's ``--dtype``: always with
    ``bfloat16``, never with ``float32``, and with ``auto`` where the CPU has native
    bfloat16 math (:func:`worker.model.dtype.cpu_has_bf16`, the CPUs where ``auto`` computes
    dense models in bfloat16) and the kernel is compiled. Everything else (norms, attention,
    the residual stream, the products of weights in other formats, the logits) stays float32.

    The rounded path makes 32 products per instruction where float32 FMAs make 16: on a
    2-core AVX-512 BF16 EPYC a SmolLM2-135M decode step was faster at every row count than
    with float32 activations, for a next-token distribution about as close to float32's as
    bfloat16 compute's (bench/RESULTS.md run 30). A choice from the hardware and the flag
    only, never from timings, and the same for every row count (batch-invariant)."""
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        return True
    if name != "auto":
        return False
    from worker.model.dtype import cpu_has_bf16

    return cpu_has_bf16() and inflight_kernels.cpu_dequant_bf16()


def _all_projections_kept(gguf_path) -> bool:
    """Every projection weight (``*_proj.weight``) of the GGUF file is in a format ``gguf`` runs
    in blocks: Q4_1 or Q8_0 (repacked) or a K-quant (the file's own blocks)."""
    from worker.model.gguf_loader import gguf_tensor_formats

    kinds = [kind for name, kind in gguf_tensor_formats(gguf_path).items() if name.endswith("_proj.weight")]
    return bool(kinds) and all(kind in GGUF_BLOCK_FORMATS + KQUANT_FORMATS for kind in kinds)


def compute_dtype(quantization: str, dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype | None:
    """The compute dtype ``quantization`` imposes: None for ``none`` (``dtype``
    then resolves as usual), float32 for ``q8_0``, ``q4_1`` and ``gguf`` (with ``gguf``,
    ``dtype`` bfloat16 only rounds the block products' activations:
    :func:`gguf_bf16_activations`).

    Raises:
        ValueError: an unknown scheme; ``q8_0`` or ``q4_1`` with a dtype other than auto or
            float32 (``gguf``: other than auto, float32 or bfloat16, and bfloat16 only
            with :func:`inflight_kernels.cpu_dequant_bf16`), on a device other than the CPU, or
            without the compiled CPU kernels (no C++ compiler, or their smoke run failed).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    name = str(dtype).removeprefix("torch.")
    if quantization == "gguf" and name == "bfloat16" and inflight_kernels.cpu_kernels_available():
        if not inflight_kernels.cpu_dequant_bf16():
            raise ValueError("--quantization gguf --dtype bfloat16 needs a CPU with AVX-512 BF16 (its Q4_1 "
                             "products round the activations with vdpbf16ps); use --dtype auto or float32")
    elif name not in ("auto", "float32"):
        raise ValueError(f"--quantization {quantization} computes in float32; drop --dtype {name} or use float32")
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on the CPU only, not on {device}")
    if not inflight_kernels.cpu_kernels_available():
        raise ValueError(f"--quantization {quantization} needs the compiled CPU kernels, which did not load "
                         "(see the warning above; `python -m inflight_kernels.cpu.build` builds them)")
    return torch.float32
