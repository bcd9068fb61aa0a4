"""The kernel ops the model calls, each dispatched (:mod:`inflight_kernels.dispatch`) to
CUDA C loaded with CuPy for CUDA tensors, to the compiled C++ of
:mod:`inflight_kernels.cpu` for CPU tensors when it is built, or to the torch reference
(:mod:`inflight_kernels.reference`, also the test oracle). Nothing here imports
``worker``.

Ops: ``paged_attention``, ``reshape_and_cache`` (docs/CONTRACTS.md); the model's decode
attention ``decode_attention`` (every path chosen inside: :mod:`inflight_kernels.paged_decode`,
with ``decode_plan`` and ``prefill_as_decode``); the fused
layer ops ``rms_norm``, ``add_rms_norm``, ``rope_qk``, ``silu_mul`` (handed out together by
``fused_layer_ops`` where they run compiled, None elsewhere); the Q8_0
GEMM ``q8_pack_weight``, ``q8_linear``, the Q4_1 GEMM ``q4_1_pack_weight``, ``q4_1_linear``, the weight-only
(float32-activation) GEMMs ``q4_1_dequant_linear``, ``q8_0_dequant_linear``, the K-quant GEMM over a
GGUF file's own blocks ``kquant_linear`` (and ``kquant_dequantize_rows`` for the embedding), the fused token sampler
``sample_tokens`` (``fused_sampler``: it, or None where it does not take the logits), the bf16 GEMM
``bf16_pack_weight``/``bf16_linear``, the batched LoRA product ``lora_apply`` (``lora_kernel``: whether it runs compiled) and ``decode_stack`` (a q8_0 decode step's layers in one
call) (compiled CPU kernels only).
Queries: ``compiled_step_gaps``, ``cpu_kernels_available``, ``cpu_fast_attention``, ``cpu_bf16_dot``, ``cpu_dequant_bf16``,
``attention_backend``, ``layer_ops_backend``, ``sampler_backend``."""

from inflight_kernels.dispatch import (
    FusedLayerOps,
    add_rms_norm,
    attention_backend,
    bf16_linear,
    bf16_pack_weight,
    compiled_step_gaps,
    cpu_bf16_dot,
    cpu_bf16_gemm,
    cpu_kquant_bf16,
    cpu_kquant_f32,
    cpu_kquant_tiles,
    cpu_dequant_bf16,
    cpu_fast_attention,
    cpu_kernels_available,
    decode_stack,
    fused_layer_ops,
    fused_sampler,
    kquant_dequantize_rows,
    kquant_linear,
    layer_ops_backend,
    lora_apply,
    lora_kernel,
    paged_attention,
    q4_1_dequant_linear,
    q4_1_linear,
    q4_1_pack_weight,
    q8_0_dequant_linear,
    q8_linear,
    q8_pack_weight,
    reshape_and_cache,
    rms_norm,
    rope_qk,
    sample_tokens,
    sampler_backend,
    silu_mul,
)
from inflight_kernels.paged_decode import decode_attention, decode_plan, prefill_as_decode
from inflight_kernels.varlen_attention import VarlenPlan

__all__ = [
    "FusedLayerOps",
    "VarlenPlan",
    "add_rms_norm",
    "attention_backend",
    "bf16_linear",
    "bf16_pack_weight",
    "compiled_step_gaps",
    "cpu_bf16_dot",
    "cpu_bf16_gemm",
    "cpu_kquant_bf16",
    "cpu_kquant_f32",
    "cpu_kquant_tiles",
    "cpu_dequant_bf16",
    "cpu_fast_attention",
    "cpu_kernels_available",
    "decode_attention",
    "decode_plan",
    "decode_stack",
    "fused_layer_ops",
    "fused_sampler",
    "kquant_dequantize_rows",
    "kquant_linear",
    "layer_ops_backend",
    "lora_apply",
    "lora_kernel",
    "paged_attention",
    "prefill_as_decode",
    "q4_1_dequant_linear",
    "q4_1_linear",
    "q4_1_pack_weight",
    "q8_0_dequant_linear",
    "q8_linear",
    "q8_pack_weight",
    "reshape_and_cache",
    "rms_norm",
    "rope_qk",
    "sample_tokens",
    "sampler_backend",
    "silu_mul",
]
