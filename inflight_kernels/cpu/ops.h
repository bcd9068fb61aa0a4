// The compiled CPU ops shared between translation units of one extension module:
// defined in layer_ops.cpp, paged_attention.cpp, q8_gemm.cpp, q4_gemm.cpp, dequant_gemm.cpp, dequant_gemm_bf16.cpp, bf16_gemm.cpp,
// kquant_gemm.cpp, lora_gemm.cpp,
// sampler.cpp and decode_stack.cpp; bound to Python in module.cpp, and called from C++ by
// decode_stack.cpp.
#pragma once

#include "aten_headers.h"

#include <cstdint>
#include <vector>

// layer_ops.cpp
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm(at::Tensor residual, at::Tensor delta, at::Tensor out, at::Tensor weight, double eps);
void rope_qk(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim);
void silu_mul(at::Tensor out, at::Tensor gate_up);
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor slot_mapping);
// paged_attention.cpp
void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t window,
                            double softcap);
bool paged_attention_bf16_dot();
// q8_gemm.cpp
std::vector<at::Tensor> q8_pack_weight(at::Tensor w);
void q8_linear(at::Tensor out, at::Tensor x, at::Tensor qw, at::Tensor dw);
// q4_gemm.cpp
at::Tensor q4_1_pack_weight(at::Tensor w);
void q4_1_linear(at::Tensor out, at::Tensor x, at::Tensor packed);
// dequant_gemm.cpp
void q4_1_dequant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, bool bf16_activations);
void q8_0_dequant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor scales, bool bf16_activations);
// dequant_gemm_bf16.cpp
bool dequant_bf16_compiled();
void q4_1_dequant_linear_bf16_raw(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t m,
                                  int64_t n, int64_t k_blocks, const uint8_t* wq);
void q8_0_dequant_linear_bf16_raw(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t m,
                                  int64_t n, int64_t k_blocks, const uint8_t* wq, const float* scales);
// sampler.cpp
void sample_tokens(at::Tensor out, at::Tensor logits, at::Tensor rows, at::Tensor temperature, at::Tensor min_p,
                   at::Tensor top_k, at::Tensor top_p, at::Tensor uniforms);
// bf16_gemm.cpp
bool bf16_gemm_compiled();
at::Tensor bf16_pack_weight(at::Tensor w);
void bf16_linear(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor bias);
// kquant_gemm.cpp
void kquant_linear(at::Tensor out, at::Tensor x, std::vector<at::Tensor> blocks, std::vector<int64_t> types,
                   int64_t dense_min_rows);
bool kquant_bf16_compiled();
bool kquant_f32_compiled();
void kquant_dequantize_rows(at::Tensor out, at::Tensor blocks, int64_t type, at::Tensor ids);
// lora_gemm.cpp
void lora_apply(at::Tensor out, at::Tensor x, at::Tensor row_slots, at::Tensor a_t, at::Tensor pieces,
                std::vector<at::Tensor> b_ts);
// decode_stack.cpp (binds its class itself; pybind11 is declared here, not included)
namespace pybind11 { class module_; }
void register_decode_stack(pybind11::module_& m);
