// The whole layer stack of a decode step in one call, for Llama-layout decoders
// on the CPU with Q8_0 or Q4_1 weights (float32 activations, rounded to Q8_0 blocks for each
// product or, weight-only, multiplied as they are by the dequantized weights), a GGUF file's
// K-quant blocks (kquant_gemm.cpp, float32 in and out) or bf16_gemm.cpp's packed bfloat16
// weights (bfloat16 activations).
//
// Why: a SmolLM2-135M decode step at batch 1 ran 30 layers x about 12 small ops
// from Python (op wrappers, views, empty tensors, pybind argument conversion).
// bench/fixed_cost.py measured that fixed part as a large share of a one-stream q8_0 step
// (bench/RESULTS.md runs 22 and 27). Here the same ops run from C++ in the same order on the
// same buffers, so the results are bit-identical to the Python fused path of
// worker/model/llama.py (LlamaDecoder._forward_fused), which stays the oracle
// (tests/worker/model/test_decode_stack.py) and the path for oneDNN's float weights
// and the torch fallbacks. Every row is attended as a decode of its own context
// (block_tables and context_lens per row): prefill and verification rows too, as the
// Python path does wherever this compiled attention runs.
//
// Per layer, as the Python path: the qkv projection (+ bias), rope_qk on the q and k
// heads, K/V cast to the cache dtype and written at the slot mapping, paged decode
// attention (the query rounded to bfloat16 first over a bfloat16 cache when the
// vdpbf16ps path is compiled, as worker.model.attention.decode_attention does),
// the o projection, add_rms_norm, gate_up, silu_mul, down,
// add_rms_norm into the next layer's input norm (the last layer only adds).

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ops.h"

namespace {

// One projection: Q8_0 (packed int8 tiles and their scales, q8_gemm.cpp), Q4_1 (packed
// uint8 tiles holding their scales, q4_gemm.cpp; scales undefined) or bfloat16 (packed
// tiles, bf16_gemm.cpp; scales undefined); a Q8_0 or Q4_1 weight's dense bfloat16 copy
// for steps of many rows (bf16_gemm.cpp's tiles, or on an AMX CPU an opaque oneDNN tensor
// from torch.ops.mkldnn._reorder_linear_weight), or undefined; output width.
struct Proj {
  at::Tensor packed, scales, dense;
  int64_t out_features;
  std::vector<at::Tensor> kquant_parts;  // a weight kept in a GGUF file's K-quant blocks (kquant_gemm.cpp)
  std::vector<int64_t> kquant_types;     // their ggml type ids; both empty for the packed formats
};

constexpr size_t kWeightsPerLayer = 15;  // 2 norms, the qkv bias, then 3 tensors per projection

struct Layer {
  at::Tensor input_norm, post_norm, qkv_bias;  // qkv_bias undefined when the model has none
  Proj qkv, o, gate_up, down;
  at::Tensor key_cache, value_cache;
  int64_t window, rope;  // sliding window (0 = full), index into forward()'s cos/sin lists
};

at::Tensor defined_or_none(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }

Proj proj(const std::vector<at::Tensor>& t, size_t at_index, int64_t out_features) {
  return {t.at(at_index), defined_or_none(t.at(at_index + 1)), defined_or_none(t.at(at_index + 2)), out_features, {}, {}};
}

// x @ W.T for bfloat16 x [rows, in] and a oneDNN-packed bfloat16 weight: bfloat16 [rows, out]
// from torch.ops.mkldnn._linear_pointwise (AMX tiles where the CPU has them), called boxed
// through the dispatcher as worker.model.quantization._dense_linear calls it from Python.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// out float32 [rows, out] = x @ dense.T with x rounded to bfloat16: on oneDNN for its opaque
// reorder (output rounded to bfloat16 there), else in bf16_gemm.cpp (float32 sums).
void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& dense) {
  const at::Tensor x16 = x.to(at::kBFloat16);
  if (dense.is_mkldnn()) out.copy_(onednn_linear(x16, dense));
  else bf16_linear(out, x16, dense, at::empty({0}, at::kFloat));
}

// x @ W.T (+ bias) as worker.model.linear.linear computes it: Q8_0 and Q4_1 in float32
// (weight-only with float_activations; from the dense copy, x rounded to bfloat16, once x has
// dense_min_rows rows), K-quants in float32 (through bfloat16 tiles from dense_min_rows rows) with the bias added after, bfloat16 with the (float32) bias added
// before the one rounding.
at::Tensor linear(const Proj& p, const at::Tensor& x, bool float_activations, bool bf16_activations,
                  int64_t dense_min_rows, const at::Tensor& bias = at::Tensor()) {
  if (!p.kquant_parts.empty()) {  // float32 in and out, as worker.model.kquant.KQuantWeight
    at::Tensor out = at::empty({x.size(0), p.out_features}, at::kFloat);
    kquant_linear(out, x, p.kquant_parts, p.kquant_types, dense_min_rows);
    if (bias.defined()) out.add_(bias);
    return out;
  }
  if (p.scales.defined() || p.packed.scalar_type() == at::kByte) {
    at::Tensor out = at::empty({x.size(0), p.out_features}, at::kFloat);
    if (p.dense.defined() && x.size(0) >= dense_min_rows) dense_linear(out, x, p.dense);
    else if (p.scales.defined() && float_activations) q8_0_dequant_linear(out, x, p.packed, p.scales, bf16_activations);
    else if (p.scales.defined()) q8_linear(out, x, p.packed, p.scales);
    else if (float_activations) q4_1_dequant_linear(out, x, p.packed, bf16_activations);
    else q4_1_linear(out, x, p.packed);
    if (bias.defined()) out.add_(bias);
    return out;
  }
  at::Tensor out = at::empty({x.size(0), p.out_features}, at::kBFloat16);
  bf16_linear(out, x, p.packed, bias.defined() ? bias : at::empty({0}, at::kFloat));
  return out;
}

}  // namespace

// Holds the weights and caches of every layer (references, no copies) and runs
// the layer loop of pure-decode steps. Built once per model runner.
class DecodeStack {
 public:
  // weights: per layer, 15 tensors in order input_norm, post_norm, qkv_bias (an empty
  // tensor when absent; float32), then (packed, scales, dense) of qkv, o, gate_up, down
  // (scales an empty tensor for Q4_1 and bfloat16 weights, dense an empty tensor where the
  // weight has no dense bfloat16 copy); caches: per
  // layer (key_cache, value_cache) [num_blocks, KVH, block_size, D]; windows and ropes:
  // per layer. out_features: qkv, o, gate_up, down widths. float_activations: Q8_0/Q4_1
  // weights multiply float32 activations (weight-only) instead of Q8_0-rounded ones.
  // bf16_activations: weight-only Q4_1 and Q8_0 products take the activations rounded to
  // bfloat16 (dequant_gemm_bf16.cpp). dense_min_rows: the row count from which the
  // projections with a dense copy use it. kquant_parts, kquant_layout: the projections held in
  // K-quant blocks (their three weights above are empty tensors): for each layer and
  // projection in order, the layout lists its part count n then the parts' n ggml type ids,
  // and kquant_parts the parts' block tensors in the same order (n = 0: a packed projection);
  // both empty when no projection is.
  DecodeStack(std::vector<at::Tensor> weights, std::vector<at::Tensor> caches, std::vector<int64_t> windows,
              std::vector<int64_t> ropes, std::vector<int64_t> out_features, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double scale, double softcap, bool round_query, bool float_activations,
              bool bf16_activations, int64_t dense_min_rows, std::vector<at::Tensor> kquant_parts,
              std::vector<int64_t> kquant_layout)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        softcap_(softcap), round_query_(round_query), float_activations_(float_activations),
        bf16_activations_(bf16_activations), dense_min_rows_(dense_min_rows) {
    const size_t n = windows.size();
    TORCH_CHECK(weights.size() == kWeightsPerLayer * n && caches.size() == 2 * n && ropes.size() == n &&
                    out_features.size() == 4,
                "DecodeStack: expected 15 weights, 2 caches, a window and a rope per layer");
    for (size_t i = 0; i < n; ++i) {
      const size_t w = kWeightsPerLayer * i;
      layers_.push_back(Layer{weights[w], weights[w + 1], defined_or_none(weights[w + 2]),
                              proj(weights, w + 3, out_features[0]), proj(weights, w + 6, out_features[1]),
                              proj(weights, w + 9, out_features[2]), proj(weights, w + 12, out_features[3]),
                              caches[2 * i], caches[2 * i + 1], windows[i], ropes[i]});
    }
    size_t part = 0, at = 0;
    for (size_t i = 0; i < n && !kquant_layout.empty(); ++i)
      for (Proj* p : {&layers_[i].qkv, &layers_[i].o, &layers_[i].gate_up, &layers_[i].down}) {
        TORCH_CHECK(at < kquant_layout.size(), "DecodeStack: kquant_layout is too short");
        const int64_t count = kquant_layout[at++];
        for (int64_t j = 0; j < count; ++j) {
          TORCH_CHECK(at < kquant_layout.size() && part < kquant_parts.size(), "DecodeStack: K-quant lists disagree");
          p->kquant_types.push_back(kquant_layout[at++]);
          p->kquant_parts.push_back(kquant_parts[part++]);
        }
      }
    TORCH_CHECK(part == kquant_parts.size() && at == kquant_layout.size(), "DecodeStack: K-quant lists disagree");
  }

  // hidden: [N, hidden] embeddings of the N decode tokens (float32 for Q8_0 and Q4_1 weights,
  // bfloat16 for bfloat16 ones), updated in place to
  // the residual stream after the last layer (before the final norm). cos/sin: per
  // distinct RoPE [N, D] in hidden's dtype; slot_mapping [N] int64; block_tables [N, max_blocks]
  // int32; context_lens [N] int32. Raises (RuntimeError) on the ops' shape checks.
  void forward(at::Tensor hidden, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor slot_mapping,
               at::Tensor block_tables, at::Tensor context_lens) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "DecodeStack.forward: hidden must be contiguous [N, hidden]");
    TORCH_CHECK(cos.size() == sin.size() && !cos.empty(), "DecodeStack.forward: cos/sin lists differ");
    if (layers_.empty()) return;
    at::Tensor normed = at::empty_like(hidden);
    rms_norm(normed, hidden, layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor attn = attention(layer, normed, cos.at(layer.rope), sin.at(layer.rope), slot_mapping, block_tables,
                                  context_lens);
      at::Tensor mlp_in = at::empty_like(hidden);
      add_rms_norm(hidden, attn, mlp_in, layer.post_norm, eps_);
      at::Tensor gate_up = linear(layer.gate_up, mlp_in, float_activations_, bf16_activations_, dense_min_rows_);
      at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
      silu_mul(act, gate_up);
      at::Tensor mlp_out = linear(layer.down, act, float_activations_, bf16_activations_, dense_min_rows_);
      if (i + 1 < layers_.size()) {
        normed = at::empty_like(hidden);
        add_rms_norm(hidden, mlp_out, normed, layers_[i + 1].input_norm, eps_);
      } else {
        hidden.add_(mlp_out);
      }
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  at::Tensor attention(const Layer& layer, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens) {
    const int64_t n = x.size(0), d = head_dim_, q_size = heads_ * d, kv_size = kv_heads_ * d;
    at::Tensor qkv = linear(layer.qkv, x, float_activations_, bf16_activations_, dense_min_rows_, layer.qkv_bias);
    rope_qk(qkv, cos, sin, heads_ + kv_heads_, d);
    const auto cache_dtype = layer.key_cache.scalar_type();
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, kv_heads_, d}).to(cache_dtype);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, kv_heads_, d}).to(cache_dtype);
    reshape_and_cache(k, v, layer.key_cache, layer.value_cache, slots);
    // the query's dtype as worker.model.attention.decode_attention gives it to the kernel: rounded
    // to bfloat16 over a bfloat16 cache (Q8_0's float32 query, with the vdpbf16ps path), the
    // cache's dtype when it is the query's, else widened to float32
    at::Tensor q = qkv.narrow(1, 0, q_size).view({n, heads_, d});
    const auto act_dtype = q.scalar_type();
    const bool rounded = round_query_ && act_dtype == at::kFloat && cache_dtype == at::kBFloat16;
    q = q.to(rounded ? at::kBFloat16 : act_dtype == cache_dtype ? act_dtype : at::kFloat).contiguous();
    at::Tensor out = at::empty_like(q);
    paged_attention_decode(out, q, layer.key_cache, layer.value_cache, tables, lens, scale_, layer.window, softcap_);
    return linear(layer.o, out.to(act_dtype).view({n, q_size}), float_activations_, bf16_activations_,
                  dense_min_rows_);
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_, softcap_;
  bool round_query_, float_activations_, bf16_activations_;
  int64_t dense_min_rows_;
};

void register_decode_stack(py::module& m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, int64_t, int64_t, int64_t, double, double, double, bool, bool, bool,
                    int64_t, std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>(),
           "run every layer of a pure-decode step in place on hidden")
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
