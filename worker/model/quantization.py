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
scale and minimum per 32 input values, :class:`Q4Weight`,
``inflight_kernels/cpu/q4_gemm.cpp``) and the lm_head in Q8_0, the layout of the default
GGUF, whose own blocks come back unchanged when its dequantized weights are
quantized again; inputs are rounded to Q8_0 blocks as for ``q8_0``. A one-stream
step reads 97 MiB of SmolLM2-135M instead of float32's 513 (its speed and accuracy:
bench/RESULTS.md run 28).

``gguf``: weight-only, for GGUF files: every projection (and the lm_head) whose
tensors the file holds in Q4_1 or in Q8_0 blocks keeps those blocks (:class:`Q4Weight`,
:class:`Q8Weight` with ``float_activations``), and the activations stay float32: the
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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import inflight_kernels
from worker.model.kquant import KQUANT_TYPES

QUANTIZATIONS = ("none", "q8_0", "q4_1", "gguf")
GGUF_BLOCK_FORMATS = ("q4_1", "q8_0")  # GGUF tensor types ``gguf`` repacks into its tiles
KQUANT_FORMATS = tuple(KQUANT_TYPES)  # kept in the file's own blocks (worker.model.kquant)
Q8_BLOCK = 32  # input values per scale
AUTO_DENSE_MIN_ROWS = 16  # --dense-weights-min-rows auto (bench/RESULTS.md runs 34 and 35: blocks win at 8)
DENSE_MEMORY_SHARE = 0.25  # auto's copies may take at most this share of the memory still available
DENSE_PACK_ROWS = 32  # the row count oneDNN tunes a dense copy's layout for (any count works)


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
        float_activations: multiply float32 inputs by the dequantized weight
            (:func:`inflight_kernels.q8_0_dequant_linear`, weight-only) instead of rounding
            them to Q8_0 blocks first (:func:`inflight_kernels.q8_linear`).
        bf16_activations: with ``float_activations``, round the inputs to bfloat16 for
            the products (``vdpbf16ps``, :func:`inflight_kernels.cpu_dequant_bf16`); the weights
            stay exact and the output float32.
        dense, dense_min_rows: see :func:`with_dense`.
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

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks and the dense copy."""
        return self.block_nbytes + _dense_bytes(self)

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
        if in_features % Q8_BLOCK:
            raise ValueError(f"q8_0 needs input widths that are multiples of {Q8_BLOCK}, got {in_features}")
        packed, scales = inflight_kernels.q8_pack_weight(weight)
        return cls(packed, scales, out_features, in_features, float_activations,
                   float_activations and bf16_activations)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``Q8_0(x) @ Q8_0(W).T`` (``x @ Q8_0(W).T`` with ``float_activations``) for
        ``x`` ``[rows, in]``: float32 ``[rows, out]`` (from the dense copy at ``dense_min_rows``
        rows or more: :func:`with_dense`)."""
        if _use_dense(self, x):
            return _dense_linear(self, x)
        if self.float_activations:
            return inflight_kernels.q8_0_dequant_linear(x, self.packed, self.scales, self.out_features,
                                               self.bf16_activations)
        return inflight_kernels.q8_linear(x, self.packed, self.scales, self.out_features)


@dataclass(frozen=True)
class Q4Weight(PackedShape):
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
        dense, dense_min_rows: see :func:`with_dense`.
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

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks and the dense copy."""
        return self.block_nbytes + _dense_bytes(self)

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
        if in_features % Q8_BLOCK:
            raise ValueError(f"q4_1 needs input widths that are multiples of {Q8_BLOCK}, got {in_features}")
        return cls(inflight_kernels.q4_1_pack_weight(weight), out_features, in_features, float_activations,
                   float_activations and bf16_activations)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``Q8_0(x) @ Q4_1(W).T`` (``x @ Q4_1(W).T`` with ``float_activations``) for
        ``x`` ``[rows, in]``: float32 ``[rows, out]`` (from the dense copy at ``dense_min_rows``
        rows or more: :func:`with_dense`)."""
        if _use_dense(self, x):
            return _dense_linear(self, x)
        if self.float_activations:
            return inflight_kernels.q4_1_dequant_linear(x, self.packed, self.out_features, self.bf16_activations)
        return inflight_kernels.q4_1_linear(x, self.packed, self.out_features)


def with_dense(weight: Q4Weight | Q8Weight, dequantized: torch.Tensor, min_rows: int) -> Q4Weight | Q8Weight:
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
        ValueError: a negative count, or a positive one without ``gguf`` blocks multiplied with
            bfloat16 activations (:func:`gguf_bf16_activations`: a CPU with AVX-512 BF16)."""
    if dense_min_rows < 0:
        raise ValueError(f"--dense-weights-min-rows must be 0 (off) or a row count, got {dense_min_rows}")
    if dense_min_rows and not _dense_usable(quantization, bf16_activations):
        raise ValueError("--dense-weights-min-rows copies GGUF Q4_1/Q8_0 blocks to dense bfloat16: it needs "
                         "--quantization gguf (or auto on a GGUF file) with bfloat16 activations, which need a "
                         f"CPU with AVX-512 BF16 (here: quantization {quantization}, bfloat16 activations "
                         f"{bf16_activations})")


def resolve_dense_min_rows(dense_min_rows: int | None, quantization: str, bf16_activations: bool) -> int:
    """``--dense-weights-min-rows`` with ``auto`` (None) resolved from the hardware and the flags:
    :data:`AUTO_DENSE_MIN_ROWS` for ``gguf`` blocks with bfloat16 activations (a CPU with
    AVX-512 BF16, where ``bf16_gemm.cpp`` is built), 0 (off) elsewhere. The model's size is
    checked later, once it is known (:func:`fit_dense_to_memory`).

    Why: the blocks' products spend instructions on unpacking and scaling every block, dense
    bfloat16 ones do not. On a 2-core AMX Xeon (oneDNN on the AMX tiles) and a 2-core Zen 4
    EPYC (``bf16_gemm.cpp``) the 32- and 64-row SmolLM2-135M steps ran faster on the copies
    (bench/RESULTS.md runs 34 and 35); at 8 rows the blocks, a quarter of the bytes, still
    win on both.

    Raises:
        ValueError: as :func:`check_dense_min_rows` for an explicit count."""
    if dense_min_rows is None:
        return AUTO_DENSE_MIN_ROWS if _dense_usable(quantization, bf16_activations) else 0
    check_dense_min_rows(dense_min_rows, quantization, bf16_activations)
    return dense_min_rows


def dense_copy_bytes(config) -> int:
    """Bytes of the dense bfloat16 copies of a model's projections and lm_head at 2 bytes per
    weight (an upper bound: only weights held in Q4_1/Q8_0 blocks get one). ``config``: a
    :class:`worker.model.model_config.ModelConfig`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    attention = hidden * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, k, v, o
    per_layer = attention + 3 * hidden * inter  # gate, up, down
    return 2 * (config.num_layers * per_layer + config.vocab_size * hidden)


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


def _dense_usable(quantization: str, bf16_activations: bool) -> bool:
    return quantization == "gguf" and bf16_activations and inflight_kernels.cpu_bf16_gemm()


def _use_dense(weight: Q4Weight | Q8Weight, x: torch.Tensor) -> bool:
    return weight.dense is not None and x.shape[0] >= weight.dense_min_rows


def _dense_linear(weight: Q4Weight | Q8Weight, x: torch.Tensor) -> torch.Tensor:
    if weight.dense.layout == torch._mkldnn:  # as decode_stack.cpp's onednn_linear
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight.dense, None, "none", [], "").float()
    return inflight_kernels.bf16_linear(x.to(torch.bfloat16), weight.dense, weight.out_features,
                                        out_dtype=torch.float32)


def _dense_bytes(weight: Q4Weight | Q8Weight) -> int:
    return 0 if weight.dense is None else 2 * weight.out_features * weight.in_features


def projection_converter(quantization: str):
    """``(projections, lm_head)``: the functions turning a float ``[out, in]`` weight into
    the ``quantization``'s weights: Q8_0 for both with ``q8_0``; with ``q4_1`` Q4_1
    projections and a Q8_0 lm_head (as llama.cpp's Q4_1 files keep their output matrix
    in 8 bits, the most sensitive one: SmolLM2-135M's Q4_1 GGUF holds it in Q8_0).

    Raises:
        ValueError: ``none``, ``gguf`` (per tensor: :func:`gguf_converter`) or an unknown scheme."""
    if quantization == "q8_0":
        return Q8Weight.quantize, Q8Weight.quantize
    if quantization == "q4_1":
        return Q4Weight.quantize, Q8Weight.quantize
    raise ValueError(f"no quantized weights for {quantization!r}")


def gguf_converter(block_format: str | None, fallback, bf16_activations: bool = False, dense_min_rows: int = 0):
    """The function turning a float ``[out, in]`` weight that a GGUF file held in
    ``block_format`` (:func:`projection_format`) into its ``gguf`` weight: a weight-only
    :class:`Q4Weight` for ``q4_1``, :class:`Q8Weight` for ``q8_0`` (either's products with
    bfloat16-rounded activations when ``bf16_activations``, and with a dense bfloat16 copy
    for steps of ``dense_min_rows`` rows or more when that is positive: :func:`with_dense`),
    else ``fallback`` (the float path's packing)."""
    if block_format not in GGUF_BLOCK_FORMATS:
        return fallback
    from inflight_kernels.reference import q4_1_round, q8_0_round

    cls, dequantized = (Q4Weight, q4_1_round) if block_format == "q4_1" else (Q8Weight, q8_0_round)

    def convert(w: torch.Tensor):
        blocks = cls.quantize(w, float_activations=True, bf16_activations=bf16_activations)
        # the blocks' own values (a GGUF file's dequantized weights come back unchanged)
        return with_dense(blocks, dequantized(w), dense_min_rows) if dense_min_rows > 0 else blocks

    return convert


def projection_format(formats: dict[str, str], names: list[str]) -> str | None:
    """The block format a fused projection keeps under ``gguf``: the GGUF tensor type
    (lower case, :func:`worker.model.gguf_loader.gguf_tensor_formats`) that all of its
    HF-named parts ``names`` present in ``formats`` share, when it is one of
    :data:`GGUF_BLOCK_FORMATS`; None (dequantized to float) when they differ, when
    another type or when none is listed. Mixed parts, e.g. a Q4_K_M file's Q4_K q and
    Q6_K v, are not re-quantized: that would change the weights."""
    kinds = {formats[name] for name in names if name in formats}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    return kind if kind in GGUF_BLOCK_FORMATS else None


def layer_formats(formats: dict[str, str], layer: int, tied_lm_head: bool) -> dict[str, str | None]:
    """:func:`projection_format` of each fused projection of decoder layer ``layer``
    (``qkv``, ``o``, ``gate_up``, ``down``, from their HF-named parts, separate or
    already fused as in Phi-3) and of the ``lm_head`` (the embedding's when tied)."""
    p = f"model.layers.{layer}."
    attn, mlp = p + "self_attn.", p + "mlp."
    parts = {"qkv": [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight", attn + "qkv_proj.weight"],
             "o": [attn + "o_proj.weight"],
             "gate_up": [mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "gate_up_proj.weight"],
             "down": [mlp + "down_proj.weight"],
             "lm_head": ["model.embed_tokens.weight" if tied_lm_head else "lm_head.weight"]}
    return {name: projection_format(formats, names) for name, names in parts.items()}


def resolve_quantization(quantization: str, model_path, dtype: str | torch.dtype, device: str | torch.device) -> str:
    """``quantization`` with ``auto`` resolved: ``gguf`` for a ``.gguf`` file whose projections
    are all in :data:`GGUF_BLOCK_FORMATS` or :data:`KQUANT_FORMATS` (read from its header), on the CPU when ``dtype`` is
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
