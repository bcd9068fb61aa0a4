"""Op wrappers of the compiled CPU kernels (built and loaded by
:mod:`inflight_kernels.cpu.build`) and what the loaded build can do.

Each op adapts its arguments (dtype casts, contiguity, int32/int64 indices)
and calls the extension, whose C++ checks raise RuntimeError on mismatched
shapes/dtypes; callers reach this backend through :mod:`inflight_kernels.dispatch`,
which asks :func:`available` and :func:`supports` first. ``paged_attention`` and ``reshape_and_cache`` have the
names and signatures of :mod:`inflight_kernels.cuda.ops`; the layer ops, the Q8_0
GEMM and the token sampler exist on the CPU only.
"""

from __future__ import annotations

from types import ModuleType

import torch

HEAD_DIMS = (32, 64, 96, 128, 256)  # head sizes the decode attention is compiled for
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # cache / layer-op storage dtypes


def _load() -> ModuleType | None:
    """:func:`inflight_kernels.cpu.build.load`, imported here rather than at the top:
    ``import inflight_kernels`` imports this module, and ``python -m inflight_kernels.cpu.build``
    must find ``inflight_kernels.cpu.build`` not yet imported (else runpy runs a second
    copy of it, with its own load cache, and warns)."""
    from inflight_kernels.cpu import build

    return build.load()


def available() -> bool:
    """True when the compiled kernels load on this machine (built, smoke run
    passed, not switched off with ``INFLIGHT_CPU_KERNELS=0``; see
    :func:`inflight_kernels.cpu.build.load`)."""
    return _load() is not None


def vector_isa() -> str | None:
    """The instruction set the decode attention was compiled for: "avx512",
    "avx2" (with FMA and F16C) or "scalar"; None when the kernels are not
    :func:`available`."""
    module = _load()
    return None if module is None else str(getattr(module, "vector_isa", "scalar"))


def fast_attention() -> bool:
    """True when the compiled kernels are :func:`available` and their decode
    attention is a vector build, AVX-512 or AVX2 (see :func:`supports`)."""
    return available() and vector_isa() in ("avx512", "avx2")


def bf16_dot() -> bool:
    """True when the compiled decode attention has the AVX-512 BF16 path
    (``vdpbf16ps``) for a bfloat16 query over a bfloat16 cache."""
    module = _load()
    return module is not None and bool(getattr(module, "bf16_dot", False))


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when :func:`paged_attention` handles these dtypes and head size
    and was compiled with AVX-512 or AVX2 (its portable scalar build is
    correct but slower than the torch paths, so those keep the job on other
    CPUs)."""
    return (fast_attention() and not query.is_cuda
            and key_cache.dtype in DTYPES and query.shape[-1] in HEAD_DIMS and key_cache.shape[1] > 0
            and query.shape[1] % key_cache.shape[1] == 0 and query.shape[1] // key_cache.shape[1] <= 64)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Paged decode attention in C++ (``inflight_kernels/cpu/paged_attention.cpp``),
    contract of :func:`inflight_kernels.reference.paged_attention`.

    ``query`` ``[S, H, D]`` (in the cache dtype, or float32: another dtype
    is widened to float32, never rounded to the cache's), caches
    ``[num_blocks, KVH, block_size, D]`` (float32, bfloat16 or float16),
    ``block_tables`` ``[S, max_blocks]`` and ``context_lens`` ``[S]`` (made
    int32 and contiguous here), ``out`` ``[S, H, D]`` (None: a new tensor like
    ``query``). Returns ``out``. Scores, softmax and
    ``P V`` accumulate in float32; the result is rounded once to ``out``'s
    dtype. Work is proportional to ``Σ context_lens`` (no padding); context
    lengths are clamped to ``max_blocks * block_size`` and 0 gives zeros.
    ``sliding_window`` (keys per query, None/0 = all; pages wholly before the
    window are not read) and ``logits_soft_cap`` (``c * tanh(x / c)`` of the
    scaled scores, None/0 = off) as in the reference.

    Raises:
        RuntimeError: kernels unavailable (check :func:`available` first) or
            mismatched shapes/dtypes (from the C++ checks).
    """
    module = _module()
    out = torch.empty_like(query) if out is None else out
    q_dtype = query.dtype if query.dtype == key_cache.dtype else torch.float32  # widening loses nothing
    q = query.to(q_dtype).contiguous()
    target = out if out.dtype == q_dtype and out.is_contiguous() else torch.empty_like(q)
    module.paged_attention_decode(target, q, key_cache, value_cache, block_tables.to(torch.int32).contiguous(),
                                  context_lens.to(torch.int32).contiguous(), float(scale), int(sliding_window or 0),
                                  float(logits_soft_cap or 0.0))
    if target is not out:
        out.copy_(target)
    return out


def _module() -> ModuleType:
    module = _load()
    if module is None:
        raise RuntimeError("CPU kernels are not available")
    return module


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Contract of :func:`inflight_kernels.reference.reshape_and_cache` (in place),
    in C++: ``key``/``value`` ``[N, KVH, D]`` (rows may be strided, e.g.
    views into a fused qkv; cast to the cache dtype), caches
    ``[num_blocks, KVH, block_size, D]``, ``slot_mapping`` ``[N]`` int
    (negative = skip).

    Raises:
        RuntimeError: kernels unavailable, a slot beyond the cache, or
            mismatched shapes/dtypes.
    """
    key, value = (t.to(key_cache.dtype) for t in (key, value))
    if key.stride(-1) != 1 or key.stride(1) != key.shape[2]:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(1) != value.shape[2]:
        value = value.contiguous()
    _module().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.int64).contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`inflight_kernels.reference.rms_norm` in one pass: ``x`` ``[N, hidden]``
    (rows may be strided), ``weight`` ``[hidden]``, same dtype; returns a new
    ``[N, hidden]`` tensor. Raises RuntimeError on mismatched shapes/dtypes."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _module().rms_norm(out, x, weight, float(eps))
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (rounded to its dtype, as torch's add),
    then :func:`rms_norm` of the sum, returned as a new tensor
    (:func:`inflight_kernels.reference.add_rms_norm`); all
    ``[N, hidden]`` (``weight`` ``[hidden]``), one dtype."""
    out = torch.empty(residual.shape, dtype=residual.dtype)
    _module().add_rms_norm(residual, delta, out, weight, float(eps))
    return out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """:func:`inflight_kernels.reference.rope_qk` in place on the first ``heads``
    heads of each fused row of ``qkv`` ``[N, >= heads * head_dim]`` (the q
    heads then the k heads); ``cos``/``sin`` ``[N, head_dim]`` in qkv's dtype."""
    _module().rope_qk(qkv, cos, sin, int(heads), int(head_dim))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`inflight_kernels.reference.silu_mul` in one pass: ``gate_up``
    ``[N, 2 * inter]`` -> new ``[N, inter]``, same dtype."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    _module().silu_mul(out, gate_up)
    return out


def q8_pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0-quantize ``weight`` ``[N, K]`` (float; K a multiple of 32) and pack
    it for :func:`q8_linear`: int8 ``[ceil(N/8), K/32, 288]`` (per tile and
    block 256 weight bytes, then 8 int32 ``-128 * sum(w)`` for the VNNI path) and float32
    scales ``[ceil(N/8), K/32, 8]`` (``inflight_kernels/cpu/q8_gemm.cpp``; padding
    columns are zero). Raises RuntimeError on another K or the kernels missing."""
    return tuple(_module().q8_pack_weight(weight.float().contiguous()))


def q8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """Contract of :func:`inflight_kernels.reference.q8_0_linear`: ``x`` ``[M, K]``
    (rows may be strided; cast to float32) against a :func:`q8_pack_weight`
    weight of ``out_features`` rows; returns a new float32 ``[M, out_features]``.
    Raises RuntimeError on mismatched shapes."""
    x = _float_rows(x)
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _module().q8_linear(out, x, packed, scales)
    return out



def q4_1_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Q4_1-quantize ``weight`` ``[N, K]`` (float; K a multiple of 32) and pack it
    for :func:`q4_1_linear`: uint8 ``[ceil(N/8), K/32, 160]`` (per tile of 8
    columns and block of 32 values: 128 bytes of 4-bit values, 8 fp16 scales,
    8 fp16 minimums; ``inflight_kernels/cpu/q4_gemm.cpp``). Raises RuntimeError on
    another K or the kernels missing."""
    return _module().q4_1_pack_weight(weight.float().contiguous())


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Contract of :func:`inflight_kernels.reference.q4_1_linear`: ``x`` ``[M, K]`` (rows
    may be strided; cast to float32) against a :func:`q4_1_pack_weight` weight of
    ``out_features`` rows; returns a new float32 ``[M, out_features]``. Raises
    RuntimeError on mismatched shapes."""
    x = _float_rows(x)
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _module().q4_1_linear(out, x, packed)
    return out


def q4_1_dequant_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                        bf16_activations: bool = False) -> torch.Tensor:
    """Contract of :func:`inflight_kernels.reference.q4_1_dequant_linear`: ``x`` ``[M, K]`` (rows may be
    strided; cast to float32) against a :func:`q4_1_pack_weight` weight of ``out_features``
    rows, dequantized in registers (``x`` rounded to bfloat16 first with ``bf16_activations``);
    returns a new float32 ``[M, out_features]``. Raises RuntimeError on mismatched shapes, or
    ``bf16_activations`` without :func:`dequant_bf16`."""
    x = _float_rows(x)
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _module().q4_1_dequant_linear(out, x, packed, bool(bf16_activations))
    return out


def dequant_bf16() -> bool:
    """True when the bfloat16-activation path of :func:`q4_1_dequant_linear` and
    :func:`q8_0_dequant_linear` was compiled
    (``inflight_kernels/cpu/dequant_gemm_bf16.cpp``: AVX-512 BF16, F, BW, VL and DQ)."""
    module = _load()
    return module is not None and bool(getattr(module, "dequant_bf16", False))


def q8_0_dequant_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        out_features: int, bf16_activations: bool = False) -> torch.Tensor:
    """Contract of :func:`inflight_kernels.reference.q8_0_dequant_linear`: ``x`` ``[M, K]`` (rows may be
    strided; cast to float32) against a :func:`q8_pack_weight` weight of ``out_features`` rows,
    dequantized in registers (``x`` rounded to bfloat16 first with ``bf16_activations``);
    returns a new float32 ``[M, out_features]``. Raises RuntimeError on mismatched shapes, or
    ``bf16_activations`` without :func:`dequant_bf16`."""
    x = _float_rows(x)
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _module().q8_0_dequant_linear(out, x, packed, scales, bool(bf16_activations))
    return out


def kquant_linear(x: torch.Tensor, blocks: list[torch.Tensor], types: list[int],
                  out: torch.Tensor | None = None, dense_min_rows: int = 0) -> torch.Tensor:
    """Contract of :func:`inflight_kernels.reference.kquant_linear`: ``x`` ``[M, K]`` (rows may be
    strided; cast to float32) against the row-wise concatenation of the K-quant tensors
    ``blocks`` (uint8 ``[rows_i, K / 256 * block bytes]``, as a GGUF file stores them) of ggml
    type ids ``types``; writes (and returns) float32 ``out`` ``[M, sum rows_i]`` (a new tensor
    when None; its rows may be strided, e.g. a column slice). ``dense_min_rows`` > 0: products
    of that many rows or more run through bfloat16 tiles where :func:`kquant_bf16`, float32
    dequantized per call where :func:`kquant_f32` (else int16, as fewer rows always do).
    Raises RuntimeError on mismatched shapes or an unknown type id."""
    x = _float_rows(x)
    if out is None:
        out = torch.empty(x.shape[0], sum(b.shape[0] for b in blocks), dtype=torch.float32)
    _module().kquant_linear(out, x, list(blocks), [int(t) for t in types], int(dense_min_rows))
    return out


def kquant_f32() -> bool:
    """True when :func:`kquant_linear` dequantizes to float32 per call for many rows
    (``inflight_kernels/cpu/kquant_f32.h``: a build with AVX2 and FMA and without AVX-512)."""
    module = _load()
    return module is not None and bool(getattr(module, "kquant_f32", False))


def kquant_bf16() -> bool:
    """True when :func:`kquant_linear` has its bfloat16 tiles for many rows
    (``inflight_kernels/cpu/kquant_bf16.h``: a build with AVX-512 F, BW and BF16)."""
    module = _load()
    return module is not None and bool(getattr(module, "kquant_bf16", False))


def lora_apply(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, a_t: torch.Tensor,
               pieces: torch.Tensor, b_ts: list[torch.Tensor]) -> torch.Tensor:
    """Contract of :func:`inflight_kernels.reference.lora_apply` in C++
    (``inflight_kernels/cpu/lora_gemm.cpp``): float32 only; ``out`` updated in place and
    returned. Raises RuntimeError on mismatched shapes or dtypes."""
    _module().lora_apply(out, x, row_slots, a_t, pieces, list(b_ts))
    return out


def kquant_dequantize_rows(blocks: torch.Tensor, ggml_type: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[n]``) of the K-quant tensor ``blocks`` (uint8 ``[N, K / 256 *
    block bytes]``) dequantized: float32 ``[n, K]``, equal to ``gguf.quants.dequantize``'s
    values. Raises RuntimeError on an id out of range or an unknown type id."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    k = blocks.shape[1] // _block_bytes(ggml_type) * 256
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    _module().kquant_dequantize_rows(out, blocks, int(ggml_type), ids)
    return out


def _block_bytes(ggml_type: int) -> int:
    """Bytes of one 256-value super-block of K-quant type id ``ggml_type`` (gguf's GGML_QUANT_SIZES).

    Raises:
        RuntimeError: not a K-quant type id (10..14)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not 10 <= int(ggml_type) <= 14:
        raise RuntimeError(f"not a K-quant ggml type id: {ggml_type}")
    return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))][1]


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 with contiguous rows (a copy only where needed)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def bf16_gemm() -> bool:
    """True when :func:`bf16_linear` was compiled (AVX-512 BF16, F, BW and VL)."""
    module = _load()
    return module is not None and bool(getattr(module, "bf16_gemm", False))


def bf16_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack a bfloat16 ``[N, K]`` weight (K even) for :func:`bf16_linear`:
    bfloat16 ``[ceil(N/16), K/2, 32]``. Raises RuntimeError on another dtype,
    an odd K or the kernels missing."""
    return _module().bf16_pack_weight(weight.contiguous())


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bfloat16 ``x`` ``[M, K]`` (rows may be strided)
    and a :func:`bf16_pack_weight` weight: a new ``[M, out_features]`` of ``out_dtype``,
    float32 sums (bias added in float32), rounded once for bfloat16 (float32: as summed).
    Raises RuntimeError on mismatched shapes or a build without AVX-512 BF16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=out_dtype)
    _module().bf16_linear(out, x, packed, _EMPTY if bias is None else bias.float().contiguous())
    return out


_EMPTY = torch.empty(0)


def decode_stack(weights: list[torch.Tensor], caches: list[torch.Tensor], windows: list[int], ropes: list[int],
                 out_features: list[int], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float, softcap: float, round_query: bool, float_activations: bool = False,
                 bf16_activations: bool = False, dense_min_rows: int = 0,
                 kquant_parts: list[torch.Tensor] | None = None, kquant_layout: list[int] | None = None):
    """A ``DecodeStack`` (``inflight_kernels/cpu/decode_stack.cpp``): every layer of a
    Llama-layout decoder with Q8_0, Q4_1 or packed bfloat16 weights, run from C++ for pure-decode steps;
    see :func:`inflight_kernels.decode_stack` for the arguments.

    Raises:
        RuntimeError: kernels unavailable, or the lists' lengths disagree."""
    return _module().DecodeStack(weights, caches, [int(w) for w in windows], [int(r) for r in ropes],
                                 [int(n) for n in out_features], int(num_heads), int(num_kv_heads), int(head_dim),
                                 float(eps), float(scale), float(softcap), bool(round_query),
                                 bool(float_activations), bool(bf16_activations), int(dense_min_rows),
                                 list(kquant_parts or []), [int(v) for v in kquant_layout or []])


def sample_tokens(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per listed row of ``logits`` in C++ (``inflight_kernels/cpu/sampler.cpp``):
    temperature, min-p, top-k, top-p, then an inverse-transform draw with the
    row's uniform, as :class:`worker.engine.sampler.Sampler`'s torch path does.

    Args:
        logits: [B, V] float32 CPU logits (rows may be strided; made float32 with
            contiguous rows here).
        rows: [R] integer row indices into ``logits`` (repeats allowed).
        temperature: [R] float, each > 0.
        min_p: [R] float in [0, 1] (0 = off).
        top_k: [R] int (0, negative or >= V = off).
        top_p: [R] float in (0, 1] (1 = off).
        uniforms: [R] float in [0, 1), one per row.

    Returns:
        [R] int64 token ids.

    Raises:
        RuntimeError: kernels unavailable, mismatched lengths, a row outside
            ``logits``, a temperature <= 0 or not finite, or min_p outside [0, 1].
    """
    logits = logits.float()
    if logits.dim() != 2 or logits.stride(-1) != 1:
        logits = logits.contiguous()
    vocab = logits.shape[-1]
    k = top_k.to(torch.int64)
    k = torch.where((k > 0) & (k < vocab), k, torch.zeros_like(k)).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    _module().sample_tokens(out, logits, rows.to(torch.int64).contiguous(),
                            temperature.to(torch.float32).contiguous(), min_p.to(torch.float64).contiguous(), k,
                            top_p.to(torch.float32).contiguous(), uniforms.to(torch.float32).contiguous())
    return out
