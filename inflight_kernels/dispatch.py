"""Backend choice for every kernel op: the one place that looks at a tensor's
device and dtype and at what the CPU build can do.

Backends, by name:

* ``"cuda"``: :mod:`inflight_kernels.cuda.ops` (CuPy RawKernels, imported lazily so
  CPU-only installs never import CuPy), for CUDA tensors;
* ``"cpu"``: the compiled C++ of :mod:`inflight_kernels.cpu.ops`, for CPU tensors when
  the extension loads (:func:`inflight_kernels.cpu.build.load`: built, smoke run passed,
  not switched off with ``INFLIGHT_CPU_KERNELS=0``) and handles the dtypes and
  sizes (decode attention only where its build is a vector one, AVX-512 or
  AVX2: the portable scalar build is slower than torch);
* ``"reference"``: the torch code of :mod:`inflight_kernels.reference` (also the test oracle).

Callers (the model, the sampler) never ask which backend runs: they call the ops here,
and where they have torch paths of their own for the ``"reference"`` case they take
the op from a function that returns None there (:func:`fused_layer_ops`,
:func:`fused_sampler`, :func:`decode_stack`, :func:`inflight_kernels.prefill_as_decode`).
The ``*_backend`` queries serve those choices, :func:`compiled_step_gaps`, the tests
and the benchmarks; nothing below ``inflight_kernels`` calls back up. Signatures and layouts:
docs/CONTRACTS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight_kernels import reference
from inflight_kernels.cpu import ops as cpu_ops


def cpu_kernels_available() -> bool:
    """True when the compiled CPU kernels load on this machine (the first call
    may build them: about a minute; see :mod:`inflight_kernels.cpu.build`)."""
    return cpu_ops.available()


def cpu_fast_attention(head_dim: int) -> bool:
    """True when the compiled CPU decode attention is a vector build (AVX-512
    or AVX2) compiled for ``head_dim``: :func:`paged_attention` then takes it
    for CPU tensors of the supported dtypes (float32, bfloat16, float16)."""
    return cpu_ops.fast_attention() and head_dim in cpu_ops.HEAD_DIMS


def cpu_bf16_dot() -> bool:
    """True when the compiled CPU decode attention has the AVX-512 BF16 path
    (``vdpbf16ps``), taken for a bfloat16 query over a bfloat16 cache."""
    return cpu_ops.bf16_dot()


def attention_backend(query: torch.Tensor, key_cache: torch.Tensor) -> str:
    """The backend :func:`paged_attention` uses for ``query``
    ``[num_seqs, num_heads, head_dim]`` over ``key_cache``
    ``[num_blocks, num_kv_heads, block_size, head_dim]``: ``"cuda"`` for CUDA
    tensors (whatever their dtypes: the CUDA op raises on bad ones),
    ``"cpu"`` when the compiled CPU kernel handles these dtypes, head size and
    GQA group (:func:`inflight_kernels.cpu.ops.supports`), else ``"reference"``."""
    if query.is_cuda:
        return "cuda"
    if cpu_ops.supports(query, key_cache):
        return "cpu"
    return "reference"


def layer_ops_backend(x: torch.Tensor) -> str:
    """The backend of :func:`rms_norm`, :func:`add_rms_norm`, :func:`rope_qk`
    and :func:`silu_mul` for tensors on ``x``'s device in ``x``'s dtype:
    ``"cpu"`` (compiled, one pass each) for CPU float32/bfloat16/float16 when
    the kernels load, else ``"reference"`` (torch; on CUDA too)."""
    if not x.is_cuda and x.dtype in cpu_ops.DTYPES and cpu_ops.available():
        return "cpu"
    return "reference"


def compiled_step_gaps(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> list[str]:
    """What of a CPU step's decode attention and fused layer ops would not run on the compiled
    kernels for a ``dtype`` query of ``head_dim`` values per head over a ``cache_dtype`` KV cache
    (:func:`attention_backend`, :func:`layer_ops_backend`): one line each, empty when both do.
    The torch fallbacks of either make a row's result depend on its batch."""
    query = torch.empty(1, 1, head_dim, dtype=dtype)
    cache = torch.empty(1, 1, 1, head_dim, dtype=cache_dtype)
    gaps = []
    if attention_backend(query, cache) != "cpu":
        gaps.append(f"the compiled attention does not serve head_dim {head_dim} with a "
                    f"{str(dtype).removeprefix('torch.')} query over a "
                    f"{str(cache_dtype).removeprefix('torch.')} cache")
    if layer_ops_backend(query) != "cpu":
        gaps.append(f"the compiled layer ops do not serve {dtype}")
    return gaps


def sampler_backend(logits: torch.Tensor) -> str:
    """The backend of :func:`sample_tokens` for ``logits`` ``[B, V]``: ``"cpu"``
    (compiled, one fused pass per row) for CPU float32 logits when the kernels
    load, else ``"reference"``: there is no torch version here, the caller
    (:class:`worker.engine.sampler.Sampler`) keeps its own torch path for it."""
    if not logits.is_cuda and logits.dtype == torch.float32 and cpu_ops.available():
        return "cpu"
    return "reference"


def _cache_write_backend(key: torch.Tensor, key_cache: torch.Tensor) -> str:
    if key.is_cuda:
        return "cuda"
    if cpu_ops.available() and key_cache.dtype in cpu_ops.DTYPES:
        return "cpu"
    return "reference"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the
    caches ``[num_blocks, num_kv_heads, block_size, head_dim]`` at
    ``slot_mapping`` ``[num_tokens]`` int64 (negative = skip). In place;
    values are cast to the cache dtype.

    Raises:
        ValueError: mismatched shapes (all backends), or on CUDA a bad device,
            contiguity or size; TypeError: on CUDA, dtypes that differ or are
            unsupported; RuntimeError: on the compiled CPU backend, a slot
            beyond the cache; ImportError: CUDA tensors without CuPy.

    See :func:`inflight_kernels.reference.reshape_and_cache`."""
    backend = _cache_write_backend(key, key_cache)
    if backend == "cuda":
        from inflight_kernels.cuda import ops as cuda_ops

        return cuda_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if backend == "cpu":
        reference.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        return cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention of ``query`` ``[num_seqs, num_heads, head_dim]`` over
    paged K/V ``[num_blocks, num_kv_heads, block_size, head_dim]``;
    ``block_tables`` ``[num_seqs, max_blocks]`` int32, ``context_lens``
    ``[num_seqs]`` int32. Returns ``out`` (or a new tensor) like ``query``;
    scores and softmax in float32 on every backend (:func:`attention_backend`).
    ``sliding_window`` (the last N keys only; None = all) and
    ``logits_soft_cap`` (tanh soft-cap of the scaled scores; None = off): the
    compiled CPU kernel and the reference take them; the CUDA kernel does not
    (yet), so CUDA tensors with either go to the torch reference, on the GPU.

    Raises:
        ValueError: mismatched shapes or num_heads not a multiple of
            num_kv_heads (all backends), or on CUDA a bad device or
            contiguity; TypeError: on CUDA, dtypes that differ or are
            unsupported; RuntimeError: on the compiled CPU backend, a block
            id outside the cache; ImportError: CUDA tensors without CuPy.

    See :func:`inflight_kernels.reference.paged_attention`."""
    backend = attention_backend(query, key_cache)
    masked = bool(sliding_window) or bool(logits_soft_cap)
    if backend == "cuda" and not masked:
        from inflight_kernels.cuda import ops as cuda_ops

        return cuda_ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out)
    if backend == "cpu":
        reference.check_attention(query, key_cache, block_tables, context_lens)
        return cpu_ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out,
                                       sliding_window, logits_soft_cap)
    return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out,
                                     sliding_window, logits_soft_cap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[num_tokens, hidden]`` (rows may be strided) with
    ``weight`` ``[hidden]`` of the same dtype; returns a new
    ``[num_tokens, hidden]`` tensor. Compiled (:func:`layer_ops_backend`)
    within one rounding step of :func:`inflight_kernels.reference.rms_norm`.

    Raises:
        RuntimeError: mismatched shapes, or (compiled) dtypes that differ."""
    if layer_ops_backend(x) == "cpu":
        return cpu_ops.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (rounded to its dtype), then
    :func:`rms_norm` of the sum as a new tensor; ``residual``, ``delta``
    ``[num_tokens, hidden]``, ``weight`` ``[hidden]``, one dtype
    (:func:`inflight_kernels.reference.add_rms_norm`).

    Raises:
        RuntimeError: mismatched shapes, or (compiled) dtypes that differ."""
    if layer_ops_backend(residual) == "cpu":
        return cpu_ops.add_rms_norm(residual, delta, weight, eps)
    return reference.add_rms_norm(residual, delta, weight, eps)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotary embeddings in place on the first ``heads`` heads of each row of
    ``qkv`` ``[num_tokens, >= heads * head_dim]`` (fused rows: the q heads,
    then the k heads); ``cos``/``sin`` ``[num_tokens, head_dim]`` in qkv's
    dtype. Bit-equal across backends (:func:`inflight_kernels.reference.rope_qk`).

    Raises:
        RuntimeError: mismatched shapes, or (compiled) dtypes that differ."""
    if layer_ops_backend(qkv) == "cpu":
        return cpu_ops.rope_qk(qkv, cos, sin, heads, head_dim)
    return reference.rope_qk(qkv, cos, sin, heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` of ``gate_up`` ``[num_tokens, 2 * inter]``:
    a new ``[num_tokens, inter]`` tensor in the same dtype
    (:func:`inflight_kernels.reference.silu_mul`; compiled within one rounding step)."""
    if layer_ops_backend(gate_up) == "cpu":
        return cpu_ops.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


@dataclass(frozen=True)
class FusedLayerOps:
    """The fused layer ops a model's fused forward calls: :func:`rms_norm`, :func:`add_rms_norm`,
    :func:`rope_qk` and :func:`silu_mul` (same signatures), as :func:`fused_layer_ops` hands them out."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    rope_qk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], None]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def fused_layer_ops(x: torch.Tensor) -> FusedLayerOps | None:
    """The fused layer ops where they run compiled for tensors on ``x``'s device in ``x``'s
    dtype (:func:`layer_ops_backend` is ``"cpu"``: CPU float32/bfloat16/float16 when the
    kernels load), else None: the caller then runs its own torch ops (a model's unfused
    forward), as for :func:`decode_stack` and :func:`inflight_kernels.prefill_as_decode`."""
    if layer_ops_backend(x) != "cpu":
        return None
    return FusedLayerOps(rms_norm, add_rms_norm, rope_qk, silu_mul)


def q8_pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0-quantize a CPU ``weight`` ``[N, K]`` (float; K a multiple of 32)
    and pack it for :func:`q8_linear`: int8 ``[ceil(N/8), K/32, 288]`` and
    float32 scales ``[ceil(N/8), K/32, 8]``. Compiled CPU kernels only (the
    packed layout is theirs; oracle :func:`inflight_kernels.reference.q8_0_linear`).

    Raises:
        RuntimeError: K not a multiple of 32, or the compiled CPU kernels are
            not available (check :func:`cpu_kernels_available`)."""
    return cpu_ops.q8_pack_weight(weight)


def q8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """``Q8_0(x) @ Q8_0(W).T`` for CPU ``x`` ``[M, K]`` (cast to float32)
    against a :func:`q8_pack_weight` weight of ``out_features`` rows: a new
    float32 ``[M, out_features]`` (:func:`inflight_kernels.reference.q8_0_linear` up to
    float32 summation order).

    Raises:
        RuntimeError: mismatched shapes, or the compiled CPU kernels are not available."""
    return cpu_ops.q8_linear(x, packed, scales, out_features)


def q4_1_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Q4_1-quantize a CPU ``weight`` ``[N, K]`` (float; K a multiple of 32) and
    pack it for :func:`q4_1_linear`: uint8 ``[ceil(N/8), K/32, 160]``. Compiled
    CPU kernels only (oracle :func:`inflight_kernels.reference.q4_1_linear`).

    Raises:
        RuntimeError: K not a multiple of 32, or the compiled CPU kernels are
            not available (check :func:`cpu_kernels_available`)."""
    return cpu_ops.q4_1_pack_weight(weight)


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``Q8_0(x) @ Q4_1(W).T`` for CPU ``x`` ``[M, K]`` (cast to float32) against
    a :func:`q4_1_pack_weight` weight of ``out_features`` rows: a new float32
    ``[M, out_features]`` (:func:`inflight_kernels.reference.q4_1_linear` up to float32
    summation order).

    Raises:
        RuntimeError: mismatched shapes, or the compiled CPU kernels are not available."""
    return cpu_ops.q4_1_linear(x, packed, out_features)


def q4_1_dequant_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                        bf16_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` for CPU ``x`` ``[M, K]`` (cast to float32) and a :func:`q4_1_pack_weight`
    weight ``W`` of ``out_features`` rows, dequantized in registers (weight-only: ``x``
    stays float32, ``inflight_kernels/cpu/dequant_gemm.cpp``): a new float32 ``[M, out_features]``
    (:func:`inflight_kernels.reference.q4_1_dequant_linear` up to float32 summation order).
    With ``bf16_activations`` ``x`` is rounded to bfloat16 and the products run through
    ``vdpbf16ps`` (``inflight_kernels/cpu/dequant_gemm_bf16.cpp``, faster on an AVX-512
    BF16 EPYC: bench/RESULTS.md run 30), as the oracle's ``bf16_activations``.

    Raises:
        RuntimeError: mismatched shapes, the compiled CPU kernels are not available, or
            ``bf16_activations`` without that path (check :func:`cpu_dequant_bf16`)."""
    return cpu_ops.q4_1_dequant_linear(x, packed, out_features, bf16_activations)


def cpu_dequant_bf16() -> bool:
    """True when the compiled CPU kernels have the bfloat16-activation path of
    :func:`q4_1_dequant_linear` and :func:`q8_0_dequant_linear` (AVX-512 BF16)."""
    return cpu_ops.dequant_bf16()


def q8_0_dequant_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        out_features: int, bf16_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` for CPU ``x`` ``[M, K]`` (cast to float32) and a :func:`q8_pack_weight`
    weight ``W`` (``packed``, ``scales``) of ``out_features`` rows, dequantized in registers
    (weight-only, ``inflight_kernels/cpu/dequant_gemm.cpp``): a new float32 ``[M, out_features]``
    (:func:`inflight_kernels.reference.q8_0_dequant_linear` up to float32 summation order);
    ``bf16_activations`` as for :func:`q4_1_dequant_linear`.

    Raises:
        RuntimeError: mismatched shapes, the compiled CPU kernels are not available, or
            ``bf16_activations`` without that path (check :func:`cpu_dequant_bf16`)."""
    return cpu_ops.q8_0_dequant_linear(x, packed, scales, out_features, bf16_activations)


def kquant_linear(x: torch.Tensor, blocks: list[torch.Tensor], types: list[int],
                  out: torch.Tensor | None = None, dense_min_rows: int = 0) -> torch.Tensor:
    """``x @ W.T`` for CPU ``x`` ``[M, K]`` (cast to float32) and ``W`` the row-wise
    concatenation of K-quant tensors held in their GGUF blocks (``blocks``: uint8
    ``[rows_i, K / 256 * block bytes]``; ``types``: ggml type ids 10..14, Q2_K..Q6_K),
    never widened in memory: each row of ``W`` is unpacked once per call and the activations
    are rounded to int16 per 256 values (``inflight_kernels/cpu/kquant_gemm.cpp``). Returns
    float32 ``out`` ``[M, sum rows_i]`` (new when None; may be a column slice of a wider
    tensor): :func:`inflight_kernels.reference.kquant_linear` within about 1e-4 relative, and
    a row's result is the same whatever the row count.

    ``dense_min_rows`` > 0 (``--dense-weights-min-rows``): a product of that many rows or more
    dequantizes the blocks in cache, per call, where the build has a path for it
    (:func:`cpu_kquant_tiles`): on AVX-512 BF16 into bfloat16 tiles multiplied with
    bfloat16-rounded activations (``inflight_kernels/cpu/kquant_bf16.h``; float32 sums; 2-3x
    faster at 16 rows and more, within bfloat16's rounding of the reference); on AVX2 + FMA
    without AVX-512 into float32 multiplied with the activations as they are
    (``inflight_kernels/cpu/kquant_f32.h``; about 1e-6 relative, 1.1-1.6x faster from 32 rows).
    Such a row's result then depends on whether its step reached ``dense_min_rows``.

    Raises:
        RuntimeError: mismatched shapes, an unknown type, or the compiled CPU kernels are
            not available (check :func:`cpu_kernels_available`)."""
    return cpu_ops.kquant_linear(x, blocks, types, out, dense_min_rows)


def kquant_dequantize_rows(blocks: torch.Tensor, ggml_type: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a K-quant tensor held in its GGUF blocks, as float32 ``[len(ids), K]``
    (the token embedding's lookup; equal to ``gguf.quants.dequantize``'s rows), compiled
    kernel when available, else :func:`inflight_kernels.reference.kquant_dequantize_rows`.

    Raises:
        RuntimeError / IndexError: an id out of range or an unknown type id."""
    if cpu_ops.available():
        return cpu_ops.kquant_dequantize_rows(blocks, ggml_type, ids)
    return reference.kquant_dequantize_rows(blocks, ggml_type, ids)


def lora_apply(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, a_t: torch.Tensor,
               pieces: torch.Tensor, b_ts: list[torch.Tensor]) -> torch.Tensor:
    """Each row's LoRA delta added to ``out`` in place, only its own adapter's columns computed
    (contract and shapes: :func:`inflight_kernels.reference.lora_apply`): the compiled kernel
    (``inflight_kernels/cpu/lora_gemm.cpp``; a row's result does not depend on its batch) for
    CPU float32 tensors when it is built, else the reference. Returns ``out``.

    Raises:
        RuntimeError: mismatched shapes or dtypes."""
    if lora_kernel(x):
        return cpu_ops.lora_apply(out, x, row_slots, a_t, pieces, b_ts)
    return reference.lora_apply(out, x, row_slots, a_t, pieces, b_ts)


def lora_kernel(x: torch.Tensor) -> bool:
    """True when :func:`lora_apply` runs compiled for activations like ``x`` (CPU float32,
    the kernels built)."""
    return not x.is_cuda and x.dtype == torch.float32 and cpu_ops.available()


def cpu_kquant_bf16() -> bool:
    """True when the compiled CPU kernels multiply K-quant blocks through bfloat16 tiles for
    many rows (:func:`kquant_linear`'s ``dense_min_rows``; AVX-512 F, BW and BF16)."""
    return cpu_ops.kquant_bf16()


def cpu_kquant_f32() -> bool:
    """True when the compiled CPU kernels multiply K-quant blocks dequantized to float32 per
    call for many rows (:func:`kquant_linear`'s ``dense_min_rows``; AVX2 and FMA, no AVX-512)."""
    return cpu_ops.kquant_f32()


def cpu_kquant_tiles() -> str | None:
    """Which dense path :func:`kquant_linear` takes for products of ``dense_min_rows`` rows or
    more: ``"bfloat16"`` (:func:`cpu_kquant_bf16`), ``"float32"`` (:func:`cpu_kquant_f32`), or
    None (every product in int16)."""
    if cpu_kquant_bf16():
        return "bfloat16"
    return "float32" if cpu_kquant_f32() else None


def cpu_bf16_gemm() -> bool:
    """True when the compiled CPU kernels have the AVX-512 BF16 GEMM
    (:func:`bf16_linear`)."""
    return cpu_ops.bf16_gemm()


def bf16_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack a CPU bfloat16 ``[N, K]`` weight (K even) for :func:`bf16_linear`:
    bfloat16 ``[ceil(N/16), K/2, 32]``, tiles of 16 output columns with input
    pairs interleaved (``inflight_kernels/cpu/bf16_gemm.cpp``).

    Raises:
        RuntimeError: another dtype, an odd K, or the compiled kernels are not available."""
    return cpu_ops.bf16_pack_weight(weight)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for CPU bfloat16 ``x`` ``[M, K]`` against a
    :func:`bf16_pack_weight` weight of ``out_features`` rows: a new ``[M, out_features]``
    of ``out_dtype`` (bfloat16 or float32), each output summed in float32 pair by pair in
    input order (so independent of M), the bias added in float32, rounded once for bfloat16.

    Raises:
        RuntimeError: mismatched shapes, or no AVX-512 BF16 build (check :func:`cpu_bf16_gemm`)."""
    return cpu_ops.bf16_linear(x, packed, out_features, bias, out_dtype)


def decode_stack(weights: list[torch.Tensor], caches: list[torch.Tensor], windows: list[int], ropes: list[int],
                 out_features: list[int], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float, softcap: float = 0.0, round_query: bool | None = None, float_activations: bool = False,
                 bf16_activations: bool = False, dense_min_rows: int = 0,
                 kquant_parts: list[torch.Tensor] | None = None, kquant_layout: list[int] | None = None):
    """The layer loop of a pure-decode step in one compiled call (CPU; Q8_0, Q4_1 or K-quant
    (:func:`kquant_linear`) weights with float32 activations, or :func:`bf16_pack_weight`
    weights with bfloat16 ones; ``inflight_kernels/cpu/decode_stack.cpp``). Its
    ``forward(hidden, cos, sin, slot_mapping, block_tables, context_lens)``
    updates ``hidden`` ``[N, hidden]`` in place to the residual stream
    after the last layer; ``cos``/``sin``: lists of ``[N, head_dim]`` in hidden's dtype,
    one per distinct RoPE; ``slot_mapping`` ``[N]`` int64; ``block_tables``
    ``[N, max_blocks]`` int32; ``context_lens`` ``[N]`` int32, contiguous. The
    same ops in the same order as the Python fused path, so bit-identical to it.

    Args:
        weights: per layer, in order: input_norm, post_norm ``[hidden]`` (hidden's dtype),
            float32 qkv bias ``[q + 2 kv]`` (an empty tensor when absent), then packed and
            scales (:func:`q8_pack_weight`; Q4_1: :func:`q4_1_pack_weight` and an empty tensor;
            bfloat16: :func:`bf16_pack_weight` and an empty tensor), then the dense copy
            (:func:`bf16_pack_weight` of the dequantized weight, on an AMX CPU its opaque oneDNN
            reorder from ``torch.ops.mkldnn._reorder_linear_weight``, or an empty tensor) of qkv,
            o, gate_up and down.
        caches: per layer key_cache, value_cache ``[num_blocks, KVH, block_size, D]``.
        windows: per layer sliding window in tokens (0 = full); ropes: per layer
            index into ``forward``'s cos/sin lists.
        out_features: widths of qkv, o, gate_up and down.
        eps, scale, softcap: RMSNorm epsilon, softmax scale, score soft-cap (0 = off).
        round_query: round the query to bfloat16 over a bfloat16 cache (the
            ``vdpbf16ps`` path); None (default): where the build has it (:func:`cpu_bf16_dot`).
        float_activations: Q8_0 and Q4_1 weights are weight-only (:func:`q8_0_dequant_linear`,
            :func:`q4_1_dequant_linear`) rather than multiplying Q8_0-rounded activations.
        bf16_activations: weight-only Q4_1 and Q8_0 products round the activations to
            bfloat16 (:func:`q4_1_dequant_linear`'s ``bf16_activations``).
        dense_min_rows: a step of at least this many rows multiplies the projections that
            have a dense copy by it instead of their blocks (activations rounded to bfloat16;
            :func:`bf16_linear` with float32 out, or oneDNN's ``mkldnn::_linear_pointwise``
            for a oneDNN reorder, whose bfloat16 output returns to float32).
        kquant_parts, kquant_layout: the projections kept in K-quant blocks, whose three
            ``weights`` are then empty tensors: for each layer and projection (qkv, o, gate_up,
            down) the layout lists the part count n, then the n parts' ggml type ids, and
            ``kquant_parts`` their uint8 block tensors in that order (n = 0: not a K-quant
            projection). None for a model without them.

    Returns:
        The kernel, or None where the compiled CPU attention does not take a query in the
        weights' dtype (``weights[0]``'s) over one of ``caches`` (:func:`attention_backend`):
        the caller then runs the layers one op at a time.

    Raises:
        RuntimeError: the compiled CPU kernels are not available, or the lists' lengths disagree."""
    probe = torch.empty(0, num_heads, head_dim, dtype=weights[0].dtype)
    if any(attention_backend(probe, key_cache) != "cpu" for key_cache in caches[::2]):
        return None
    if round_query is None:
        round_query = cpu_bf16_dot()
    return cpu_ops.decode_stack(weights, caches, windows, ropes, out_features, num_heads, num_kv_heads, head_dim, eps,
                                scale, softcap, round_query, float_activations, bf16_activations, dense_min_rows,
                                kquant_parts, kquant_layout)


def sample_tokens(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One sampled token per listed row of CPU ``logits`` ``[B, V]`` float32:
    ``x / temperature``, min-p (drop tokens below ``min_p`` times the row's top
    probability), top-k, then top-p (the shortest descending prefix reaching
    ``top_p``, mass taken over the top-k survivors), then the first token whose
    cumulative probability reaches the row's uniform: in vocabulary order when
    neither top-k nor top-p truncates, else in descending-probability order.
    Compiled CPU kernels only (:func:`sampler_backend`); the definition, and the
    fallback, is :class:`worker.engine.sampler.Sampler`'s torch path, and the
    results agree with it except where a uniform or ``top_p`` lies within float
    rounding of a cumulative-probability boundary.

    Args:
        logits: [B, V] float32 on the CPU.
        rows: [R] int row indices into ``logits``.
        temperature: [R] float, > 0.
        min_p: [R] float in [0, 1], 0 = off.
        top_k: [R] int, 0 / negative / >= V = off.
        top_p: [R] float in (0, 1], 1 = off.
        uniforms: [R] float in [0, 1).

    Returns:
        [R] int64 token ids.

    Raises:
        RuntimeError: the compiled CPU kernels are not available, or bad
            arguments (mismatched lengths, a row outside ``logits``, a
            temperature <= 0, min_p outside [0, 1])."""
    return cpu_ops.sample_tokens(logits, rows, temperature, min_p, top_k, top_p, uniforms)


def fused_sampler(logits: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """:func:`sample_tokens` where it takes ``logits`` ``[B, V]`` (:func:`sampler_backend` is
    ``"cpu"``: CPU float32 logits when the kernels load), else None: there is no torch
    version here, the caller (:class:`worker.engine.sampler.Sampler`) then runs its own
    torch path. Asked before the caller draws its uniforms, so either path draws them once."""
    return sample_tokens if sampler_backend(logits) == "cpu" else None
