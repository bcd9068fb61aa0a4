// Fused element-wise parts of a Llama decoder layer for the CPU: each replaces
// a chain of 4-8 small torch ops (one pass over memory and one dispatch instead
// of several) and rounds to the storage dtype at the same points as the torch
// code in inflight_kernels/reference.py (HF LlamaRMSNorm / apply_rotary_pos_emb /
// SiLU numerics), so results match it up to float32 summation order.
//
// Rows are split between torch's intra-op threads with at::parallel_for.

#include "aten_headers.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "scalar.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define INFLIGHT_LAYER_SIMD 1
#endif

namespace {

#if defined(__AVX512F__)
#include "simd_avx512.h"
#include "simd_exp.h"
#elif defined(INFLIGHT_LAYER_SIMD)
#include "simd_avx2.h"
#include "simd_exp.h"
#endif

template <typename T>
inline float to_f(T x) { return inflight_cpu::load_f(x); }

// Round to the storage dtype and back: the value torch would hold after an op.
template <typename T>
inline float rnd(float x) { return to_f(T(x)); }
template <>
inline float rnd<float>(float x) { return x; }

constexpr int64_t kRowsPerTask = 4;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// y = w * dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32.
template <typename T>
void rms_norm_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    sum += v * v;
  }
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = T(to_f(w[i]) * rnd<T>(to_f(x[i]) * r));
}

template <typename T>
void rms_norm_impl(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row<T>(xp + r * xs, wp, op + r * os, n, static_cast<float>(eps));
  });
}

// residual = dtype(residual + delta) in place, then out = rms_norm(residual).
template <typename T>
void add_rms_norm_impl(at::Tensor residual, const at::Tensor& delta, at::Tensor out, const at::Tensor& weight,
                       double eps) {
  const int64_t rows = residual.size(0), n = residual.size(1);
  const int64_t rs = residual.stride(0), ds = delta.stride(0), os = out.stride(0);
  T* rp = residual.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* row = rp + r * rs;
      const T* d = dp + r * ds;
      for (int64_t i = 0; i < n; ++i) row[i] = T(to_f(row[i]) + to_f(d[i]));
      rms_norm_row<T>(row, wp, op + r * os, n, static_cast<float>(eps));
    }
  });
}

// In place on the q and k heads of fused qkv rows [N, (H + 2*KVH) * D]:
// x = dtype(dtype(x * cos) + dtype(rotate_half(x) * sin)), NeoX/HF rotate_half.
template <typename T>
void rope_impl(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), qs = qkv.stride(0), cs = cos.stride(0), half = head_dim / 2;
  T* qp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* c = cp + r * cs;
      const T* s = sp + r * cs;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qp + r * qs + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          const float lo = rnd<T>(rnd<T>(x1 * to_f(c[i])) + rnd<T>(-x2 * to_f(s[i])));
          const float hi = rnd<T>(rnd<T>(x2 * to_f(c[i + half])) + rnd<T>(x1 * to_f(s[i + half])));
          x[i] = T(lo);
          x[i + half] = T(hi);
        }
      }
    }
  });
}

using inflight_cpu::exp_approx;

// o[i] = dtype(dtype(silu(g[i])) * u[i]) for i < n.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n, int64_t i = 0) {
  for (; i < n; ++i) {
    const float x = to_f(g[i]);
    o[i] = T(rnd<T>(x / (1.0f + exp_approx(-x))) * to_f(u[i]));
  }
}

#if defined(INFLIGHT_LAYER_SIMD)
// float32 on Simd::W lanes (the vector exp of the attention softmax; gcc left the
// scalar loop's exp_approx and division scalar, a visible share of a SmolLM2-135M float32
// decode step: bench/RESULTS.md, "Measurements first recorded in docstrings"), then the
// scalar tail.
template <>
void silu_mul_row<float>(const float* g, const float* u, float* o, int64_t n, int64_t i) {
  using S = Simd;
  const S::R one = S::set1(1.0f);
  for (; i + S::W <= n; i += S::W) {
    const S::R x = S::loadu(g + i);
    const S::R silu = S::div(x, S::add(one, vexp<S>(S::sub(S::zero(), x))));
    S::storeu(o + i, S::mul(silu, S::loadu(u + i)));
  }
  for (; i < n; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}
#endif

// out[N, I] = dtype(dtype(silu(gate)) * up) from gate_up [N, 2I].
template <typename T>
void silu_mul_impl(at::Tensor out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inter = out.size(1), gs = gate_up.stride(0), os = out.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_mul_row<T>(gp + r * gs, gp + r * gs + inter, op + r * os, inter);
  });
}

// key/value [N, KVH, D] (rows may be strided, heads contiguous) into the caches
// [num_blocks, KVH, block_size, D] at slot_mapping [N] int64; negative = skip.
template <typename T>
void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                            at::Tensor value_cache, const at::Tensor& slots) {
  const int64_t n = key.size(0), kvh = key.size(1), d = key.size(2);
  const int64_t bs = key_cache.size(2), num_blocks = key_cache.size(0);
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] < num_blocks * bs, "reshape_and_cache: slot ", sp[t], " beyond the cache");
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sp[t] < 0) continue;
      const int64_t block = sp[t] / bs, off = sp[t] % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        const int64_t dst = ((block * kvh + h) * bs + off) * d;
        std::memcpy(kc + dst, kp + t * ks + h * d, d * sizeof(T));
        std::memcpy(vc + dst, vp + t * vs + h * d, d * sizeof(T));
      }
    }
  });
}

#define INFLIGHT_DISPATCH(dtype, name, ...)                                           \
  switch (dtype) {                                                                    \
    case at::kFloat: return name<float>(__VA_ARGS__);                                 \
    case at::kBFloat16: return name<c10::BFloat16>(__VA_ARGS__);                      \
    case at::kHalf: return name<c10::Half>(__VA_ARGS__);                              \
    default: TORCH_CHECK(false, #name ": unsupported dtype ", dtype);                 \
  }

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && out.sizes() == x.sizes() &&
                  x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: shapes or dtypes differ");
  INFLIGHT_DISPATCH(x.scalar_type(), rms_norm_impl, out, x, weight, eps);
}

void add_rms_norm(at::Tensor residual, at::Tensor delta, at::Tensor out, at::Tensor weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1) && delta.sizes() == residual.sizes() &&
                  out.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type() &&
                  out.scalar_type() == residual.scalar_type() && weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: shapes or dtypes differ");
  INFLIGHT_DISPATCH(residual.scalar_type(), add_rms_norm_impl, residual, delta, out, weight, eps);
}

void rope_qk(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  TORCH_CHECK(sin.strides() == cos.strides() && sin.sizes() == cos.sizes() && cos.size(0) == qkv.size(0) &&
                  cos.size(1) == head_dim && head_dim % 2 == 0 && heads * head_dim <= qkv.size(1) &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_qk: shapes or dtypes differ");
  INFLIGHT_DISPATCH(qkv.scalar_type(), rope_impl, qkv, cos, sin, heads, head_dim);
}

void silu_mul(at::Tensor out, at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0) &&
                  gate_up.scalar_type() == out.scalar_type(),
              "silu_mul: shapes or dtypes differ");
  INFLIGHT_DISPATCH(out.scalar_type(), silu_mul_impl, out, gate_up);
}

void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "reshape_and_cache: key/value must be [N, KVH, D] with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.size(1) == key.size(1) && key_cache.size(3) == key.size(2),
              "reshape_and_cache: cache shape mismatch");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache: key, value and caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "reshape_and_cache: slot_mapping must be [N] int64");
  INFLIGHT_DISPATCH(key.scalar_type(), reshape_and_cache_impl, key, value, key_cache, value_cache, slot_mapping);
}
