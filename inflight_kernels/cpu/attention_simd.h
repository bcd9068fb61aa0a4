// Vector loops of the paged decode attention (paged_attention.cpp), written
// once over `Simd` (simd_avx512.h: 16 lanes, or simd_avx2.h: 8 lanes): the
// per-chunk Q.K scores, the softmax numerators and the P.V sums. Included by
// paged_attention.cpp inside its namespace, after Pages, exp_approx and Simd.
#pragma once

#include "simd_exp.h"

// Heads per chunk: 256 / D, at most 8 (4 at head_dim 64, 2 at 128, 1 at 256). With
// AVX-512 the chunk's G * D / 16 accumulators stay in the 32 zmm registers. With
// AVX2 they exceed the 16 ymm registers and spill to L1, and each K/V row is still
// read once per chunk: measured at head_dim 64, group 3, fp32 (bench/decode_attention.py,
// AMD EPYC 2 vCPUs), 3 heads per chunk were 20-27% faster than 1 at batch 32-64.
template <int D>
constexpr int kMaxChunk = std::clamp(256 / D, 1, 8);

// Every 64-byte line of [p, p + bytes) into L1 (prefetcht0). Written as volatile asm:
// with _mm_prefetch, gcc 12 -O3 deleted this loop, inlined into paged_attention.cpp's
// page walk, as a loop without effects (no prefetcht0 was left in the binary).
inline void prefetch_page(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __asm__ volatile("prefetcht0 %0" : : "m"(c[off]));
}

// scores[h * ctx + t] = q_h . k_t for G heads (q already scaled, [G, D]), for the
// tokens of pages [p0, p1). Full tiles of W tokens are converted to float once, then
// per head W dot products are reduced together (Simd::row_sums); the tail goes token
// by token.
template <typename T, int D, int G>
void chunk_scores(const Pages<T>& keys, int64_t p0, int64_t p1, const float* q, float* scores) {
  using S = Simd;
  constexpr int W = S::W, V = D / W;
  // q in registers; where G * V exceeds the register file (AVX2, G > 1) the
  // compiler keeps part of it in L1 (measured no slower than loading q at each use)
  typename S::R qv[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) qv[h][v] = S::loadu(q + h * D + W * v);
  const int64_t ctx = keys.ctx;
  for (int64_t i = p0; i < p1; ++i) {
    const T* rows = keys.page(i);
    const int64_t n = keys.rows(i), t0 = i * keys.block_size;
    if (i + 1 < p1) prefetch_page(keys.page(i + 1), keys.block_size * D * sizeof(T));
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      alignas(64) float tile[W * D];
      for (int r = 0; r < W; ++r)
        for (int v = 0; v < V; ++v) S::store(tile + r * D + W * v, S::from(rows + (j + r) * D + W * v));
      for (int h = 0; h < G; ++h) {
        typename S::R acc[W];
        for (int r = 0; r < W; ++r) {
          typename S::R a = S::mul(qv[h][0], S::load(tile + r * D));
          for (int v = 1; v < V; ++v) a = S::fmadd(qv[h][v], S::load(tile + r * D + W * v), a);
          acc[r] = a;
        }
        S::storeu(scores + h * ctx + t0 + j, S::row_sums(acc));
      }
    }
    for (; j < n; ++j) {
      typename S::R k[V];
      for (int v = 0; v < V; ++v) k[v] = S::from(rows + j * D + W * v);
      for (int h = 0; h < G; ++h) {
        typename S::R a = S::mul(qv[h][0], k[0]);
        for (int v = 1; v < V; ++v) a = S::fmadd(qv[h][v], k[v], a);
        scores[h * ctx + t0 + j] = S::reduce_add(a);
      }
    }
  }
}

#if defined(INFLIGHT_BF16_DOT)
// chunk_scores for a bfloat16 query over a bfloat16 cache (AVX-512 BF16):
// scores[h * ctx + t] = scale * (q_h . k_t), q unscaled [G, D]. vdpbf16ps
// multiplies 32 bf16 pairs exactly and adds each pair's sum into a float32 lane,
// so neither q nor K is converted and a 64-wide dot product is two instructions
// (the float path converts K, stores it and issues four FMAs per head). Tiles of
// 16 tokens are reduced together (Simd::row_sums), as in chunk_scores.
// 16 float32 lanes whose sum is q . k for one bf16 row k of 32 * V values.
template <int V>
inline __m512 dot_lanes_bf16(const __m512bh* q, const c10::BFloat16* k) {
  __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
  for (int v = 1; v < V; ++v) a = _mm512_dpbf16_ps(a, q[v], (__m512bh)_mm512_loadu_si512(k + 32 * v));
  return a;
}

template <int D, int G>
void chunk_scores_bf16(const Pages<c10::BFloat16>& keys, int64_t p0, int64_t p1, const c10::BFloat16* q, float scale,
                       float* scores) {
  using S = Simd;
  static_assert(S::W == 16 && D % 32 == 0, "bf16 pairs: 32 values per register");
  constexpr int W = S::W, V = D / 32;
  __m512bh qv[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) qv[h][v] = (__m512bh)_mm512_loadu_si512(q + h * D + 32 * v);
  const __m512 sv = S::set1(scale);
  const int64_t ctx = keys.ctx;
  for (int64_t i = p0; i < p1; ++i) {
    const c10::BFloat16* rows = keys.page(i);
    const int64_t n = keys.rows(i), t0 = i * keys.block_size;
    if (i + 1 < p1) prefetch_page(keys.page(i + 1), keys.block_size * D * sizeof(c10::BFloat16));
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      for (int h = 0; h < G; ++h) {
        __m512 acc[W];
        for (int r = 0; r < W; ++r) acc[r] = dot_lanes_bf16<V>(qv[h], rows + (j + r) * D);
        S::storeu(scores + h * ctx + t0 + j, S::mul(S::row_sums(acc), sv));
      }
    }
    for (; j < n; ++j) {
      for (int h = 0; h < G; ++h) scores[h * ctx + t0 + j] = S::reduce_add(dot_lanes_bf16<V>(qv[h], rows + j * D)) * scale;
    }
  }
}

// The probabilities of one head [ctx] float32 rounded to bfloat16 in place: the
// row's first half becomes its bf16 copy (element t written at or below float t).
// Rounding p to bf16 (8 bits) is the bf16 output's own precision; torch's bf16
// attention rounds the probabilities to bf16 too.
inline void probs_to_bf16(float* row, int64_t ctx) {
  uint16_t* pb = reinterpret_cast<uint16_t*>(row);
  int64_t t = 0;
  for (; t + 16 <= ctx; t += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + t)));
  for (; t < ctx; ++t) pb[t] = c10::BFloat16(row[t]).x;
}

// chunk_values for a bfloat16 query over a bfloat16 cache (AVX-512 BF16): acc_h +=
// sum_t p_h[t] v_t over the tokens of pages [p0, p1), probs [G, ctx] already rounded
// by probs_to_bf16, acc [G, D] float32 in finish_values_bf16's lane order. Tokens go
// in pairs: the rows of t and t+1 interleaved (unpacklo/hi_epi16) meet the broadcast
// pair (p[t], p[t+1]), and vdpbf16ps adds both products to a float32 lane per d, so
// one instruction does two tokens' FMAs with no conversion of V. A lone last row of a
// page is paired with zeros, never with the (possibly NaN) row after it.
template <int D, int G>
void chunk_values_bf16(const Pages<c10::BFloat16>& values, int64_t p0, int64_t p1, const float* probs, float* acc_mem) {
  using S = Simd;
  constexpr int V = D / 32;  // 32 bf16 per register
  const int64_t ctx = values.ctx;
  const uint16_t* pb[G];
  for (int h = 0; h < G; ++h) pb[h] = reinterpret_cast<const uint16_t*>(probs + h * ctx);
  __m512 acc[G][2 * V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < 2 * V; ++v) acc[h][v] = S::loadu(acc_mem + h * D + 16 * v);
  for (int64_t i = p0; i < p1; ++i) {
    const c10::BFloat16* rows = values.page(i);
    const int64_t n = values.rows(i), t0 = i * values.block_size;
    if (i + 1 < p1) prefetch_page(values.page(i + 1), values.block_size * D * sizeof(c10::BFloat16));
    for (int64_t j = 0; j < n; j += 2) {
      const bool pair = j + 1 < n;
      __m512bh p[G];
      for (int h = 0; h < G; ++h) {
        uint32_t two = pb[h][t0 + j];
        if (pair) two |= uint32_t(pb[h][t0 + j + 1]) << 16;
        p[h] = (__m512bh)_mm512_set1_epi32(int32_t(two));
      }
      for (int v = 0; v < V; ++v) {
        const __m512i a = _mm512_loadu_si512(rows + j * D + 32 * v);
        const __m512i b = pair ? _mm512_loadu_si512(rows + (j + 1) * D + 32 * v) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < G; ++h) {
          acc[h][2 * v] = _mm512_dpbf16_ps(acc[h][2 * v], p[h], lo);
          acc[h][2 * v + 1] = _mm512_dpbf16_ps(acc[h][2 * v + 1], p[h], hi);
        }
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < 2 * V; ++v) S::storeu(acc_mem + h * D + 16 * v, acc[h][v]);
}

// out [D] = inv_sum * one head's acc of chunk_values_bf16, back in d order: lane 4L + k
// of register 2v holds d = 32v + 8L + k, of register 2v + 1 d = 32v + 8L + 4 + k
// (unpack works within 128-bit lanes L = 0..3, k = 0..3).
template <int D>
void finish_values_bf16(const float* acc, float inv_sum, float* out) {
  for (int v = 0; v < D / 32; ++v)
    for (int lane = 0; lane < 4; ++lane)
      for (int k = 0; k < 4; ++k) {
        out[32 * v + 8 * lane + k] = acc[32 * v + 4 * lane + k] * inv_sum;
        out[32 * v + 8 * lane + 4 + k] = acc[32 * v + 16 + 4 * lane + k] * inv_sum;
      }
}
#endif

// acc_h += sum_t p_h[t] v_t for G heads over the tokens of pages [p0, p1), probs
// [G, ctx], acc [G, D] float32 (in registers for the walk).
template <typename T, int D, int G>
void chunk_values(const Pages<T>& values, int64_t p0, int64_t p1, const float* probs, float* acc_mem) {
  using S = Simd;
  constexpr int W = S::W, V = D / W;
  typename S::R acc[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) acc[h][v] = S::loadu(acc_mem + h * D + W * v);
  const int64_t ctx = values.ctx;
  for (int64_t i = p0; i < p1; ++i) {
    const T* rows = values.page(i);
    const int64_t n = values.rows(i), t0 = i * values.block_size;
    if (i + 1 < p1) prefetch_page(values.page(i + 1), values.block_size * D * sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      typename S::R p[G];
      for (int h = 0; h < G; ++h) p[h] = S::set1(probs[h * ctx + t0 + j]);
      for (int v = 0; v < V; ++v) {
        const typename S::R val = S::from(rows + j * D + W * v);
        for (int h = 0; h < G; ++h) acc[h][v] = S::fmadd(p[h], val, acc[h][v]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) S::storeu(acc_mem + h * D + W * v, acc[h][v]);
}

// In place s[t] = exp(s[t] - max s); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  using S = Simd;
  constexpr int W = S::W;
  typename S::R m = S::set1(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + W <= n; t += W) m = S::max(m, S::loadu(s + t));
  float mx = S::reduce_max(m);
  for (int64_t i = t; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  const typename S::R mv = S::set1(mx);
  typename S::R sum = S::zero();
  for (t = 0; t + W <= n; t += W) {
    const typename S::R e = vexp<S>(S::sub(S::loadu(s + t), mv));
    S::storeu(s + t, e);
    sum = S::add(sum, e);
  }
  float total = S::reduce_add(sum);
  for (; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}
