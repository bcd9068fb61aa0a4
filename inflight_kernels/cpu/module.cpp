// The extension module's Python bindings, and only them: every op is defined in its own
// translation unit (ops.h lists them) and bound here, so no op's file depends on another's
// registration (decode_stack.cpp calls paged_attention.cpp's op; neither registers the other).

#include <torch/extension.h>

#include "ops.h"

// Every op releases the GIL while it runs, as torch's own ops do: the worker's
// asyncio thread (links, Redis, metrics) then runs beside the step instead of
// waiting for it, and the step does not wait for that thread's Python.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention_decode", &paged_attention_decode, release_gil(), "Paged decode attention (CPU)",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
#if defined(__AVX512F__)
  m.attr("vector_isa") = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  m.attr("vector_isa") = "avx2";
#else
  m.attr("vector_isa") = "scalar";
#endif
  m.attr("bf16_dot") = paged_attention_bf16_dot();  // bf16 query x bf16 cache scores through vdpbf16ps
  m.def("rms_norm", &rms_norm, "RMSNorm, HF numerics", release_gil());
  m.def("add_rms_norm", &add_rms_norm, "residual += delta, then RMSNorm", release_gil());
  m.def("rope_qk", &rope_qk, "rotary embedding in place on fused qkv rows", release_gil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release_gil());
  m.def("reshape_and_cache", &reshape_and_cache, "write K/V into the paged cache", release_gil());
  m.def("q8_pack_weight", &q8_pack_weight, "Q8_0-quantize and pack a [N, K] weight", release_gil());
  m.def("q8_linear", &q8_linear, "out = Q8_0(x) @ Q8_0(W).T", release_gil());
  m.def("q4_1_pack_weight", &q4_1_pack_weight, "Q4_1-quantize and pack a [N, K] weight", release_gil());
  m.def("q4_1_linear", &q4_1_linear, "out = Q8_0(x) @ Q4_1(W).T", release_gil());
  m.def("q4_1_dequant_linear", &q4_1_dequant_linear, "out = x @ Q4_1(W).T, x float32, bfloat16 if asked", release_gil());
  m.attr("dequant_bf16") = dequant_bf16_compiled();  // the weight-only GEMMs' vdpbf16ps path
  m.def("q8_0_dequant_linear", &q8_0_dequant_linear, "out = x @ Q8_0(W).T, x float32, bfloat16 if asked", release_gil());
  m.def("kquant_linear", &kquant_linear, "out = x @ W.T, W in K-quant blocks (bf16 tiles from dense_min_rows)", release_gil(),
        py::arg("out"), py::arg("x"), py::arg("blocks"), py::arg("types"), py::arg("dense_min_rows") = 0);
  m.attr("kquant_bf16") = kquant_bf16_compiled();  // kquant_linear's bfloat16 tiles for many rows
  m.attr("kquant_f32") = kquant_f32_compiled();    // its float32 dequantization for many rows (AVX2 + FMA)
  m.def("kquant_dequantize_rows", &kquant_dequantize_rows, "rows of a K-quant tensor as float32", release_gil());
  m.def("sample_tokens", &sample_tokens, "temperature, min-p, top-k, top-p, inverse-CDF draw", release_gil());
  m.attr("bf16_gemm") = bf16_gemm_compiled();  // bf16_linear's vdpbf16ps kernel
  m.def("bf16_pack_weight", &bf16_pack_weight, "pack a bfloat16 [N, K] weight for bf16_linear", release_gil());
  m.def("bf16_linear", &bf16_linear, "out = x @ W.T (+ bias), bfloat16, float32 sums", release_gil());
  m.def("lora_apply", &lora_apply, "out += each row's LoRA delta, rows grouped by adapter", release_gil());
  register_decode_stack(m);
}
