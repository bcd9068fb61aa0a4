// Portable scalar pieces of the paged decode attention (paged_attention.cpp),
// for CPUs with neither AVX-512 nor AVX2: correct, and slower than the torch
// paths, so inflight_kernels/cpu_ops.py keeps attention in torch there. Included by
// paged_attention.cpp inside its namespace, after Pages, load_f and exp_approx.
#pragma once

inline void prefetch_page(const void*, int64_t) {}

// attention_simd.h's loops, one element at a time: scores of pages [p0, p1).
template <typename T, int D, int G>
void chunk_scores(const Pages<T>& keys, int64_t p0, int64_t p1, const float* q, float* scores) {
  const int64_t t1 = std::min(keys.ctx, p1 * keys.block_size);
  for (int64_t t = p0 * keys.block_size; t < t1; ++t) {
    const T* row = keys.page(t / keys.block_size) + (t % keys.block_size) * D;
    for (int h = 0; h < G; ++h) {
      float s = 0.0f;
      for (int d = 0; d < D; ++d) s += q[h * D + d] * load_f(row[d]);
      scores[h * keys.ctx + t] = s;
    }
  }
}

// acc [G, D] += the probabilities times the values of pages [p0, p1).
template <typename T, int D, int G>
void chunk_values(const Pages<T>& values, int64_t p0, int64_t p1, const float* probs, float* acc) {
  const int64_t t1 = std::min(values.ctx, p1 * values.block_size);
  for (int64_t t = p0 * values.block_size; t < t1; ++t) {
    const T* row = values.page(t / values.block_size) + (t % values.block_size) * D;
    for (int h = 0; h < G; ++h)
      for (int d = 0; d < D; ++d) acc[h * D + d] += probs[h * values.ctx + t] * load_f(row[d]);
  }
}

inline float softmax_numerators(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}

template <int D>
constexpr int kMaxChunk = 8;
