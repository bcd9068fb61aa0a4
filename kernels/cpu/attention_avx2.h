// AVX2 + FMA + F16C pieces of the paged decode attention (paged_attention.cpp)
// for CPUs without AVX-512 (AMD Zen 1-3, Intel before Skylake-SP, most
// laptops): the same algorithm as attention_avx512.h on 8 lanes and 16
// registers. Included by paged_attention.cpp inside its namespace, after
// Pages, load_f and exp_approx.
#pragma once

// 8 floats from 8 elements of the cache dtype.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// exp_approx on 8 lanes: same clamp and polynomial, 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lane L of row_sums8(v) = sum of the 8 lanes of v[L]: two rounds of hadd
// give each 128-bit half's partial sums of four rows, then the halves add.
inline __m256 row_sums8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline void prefetch_page(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// scores[h * ctx + t] = q_h . k_t for G heads (q already scaled, [G, D]).
template <typename T, int D, int G>
void chunk_scores(const Pages<T>& keys, const float* q, float* scores) {
  constexpr int V = D / 8;
  const int64_t pages = keys.count(), ctx = keys.ctx;
  for (int64_t i = 0; i < pages; ++i) {
    const T* rows = keys.page(i);
    const int64_t n = keys.rows(i), t0 = i * keys.block_size;
    if (i + 1 < pages) prefetch_page(keys.page(i + 1), keys.block_size * D * sizeof(T));
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {  // 8 tokens converted once, then per head 8 dot products reduced together
      alignas(32) float tile[8 * D];
      for (int r = 0; r < 8; ++r)
        for (int v = 0; v < V; ++v) _mm256_store_ps(tile + r * D + 8 * v, load8(rows + (j + r) * D + 8 * v));
      for (int h = 0; h < G; ++h) {
        const float* qh = q + h * D;
        __m256 acc[8];
        for (int r = 0; r < 8; ++r) {
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_load_ps(tile + r * D));
          for (int v = 1; v < V; ++v)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), _mm256_load_ps(tile + r * D + 8 * v), a);
          acc[r] = a;
        }
        _mm256_storeu_ps(scores + h * ctx + t0 + j, row_sums8(acc));
      }
    }
    for (; j < n; ++j) {
      for (int h = 0; h < G; ++h) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q + h * D), load8(rows + j * D));
        for (int v = 1; v < V; ++v) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + 8 * v), load8(rows + j * D + 8 * v), a);
        scores[h * ctx + t0 + j] = reduce_add8(a);
      }
    }
  }
}

// out_h = sum_t p_h[t] v_t for G heads, accumulators in registers; inv_sum[h] normalises.
template <typename T, int D, int G>
void chunk_values(const Pages<T>& values, const float* probs, const float* inv_sum, float* out) {
  constexpr int V = D / 8;
  __m256 acc[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) acc[h][v] = _mm256_setzero_ps();
  const int64_t pages = values.count(), ctx = values.ctx;
  for (int64_t i = 0; i < pages; ++i) {
    const T* rows = values.page(i);
    const int64_t n = values.rows(i), t0 = i * values.block_size;
    if (i + 1 < pages) prefetch_page(values.page(i + 1), values.block_size * D * sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      __m256 p[G];
      for (int h = 0; h < G; ++h) p[h] = _mm256_broadcast_ss(probs + h * ctx + t0 + j);
      for (int v = 0; v < V; ++v) {
        const __m256 val = load8(rows + j * D + 8 * v);
        for (int h = 0; h < G; ++h) acc[h][v] = _mm256_fmadd_ps(p[h], val, acc[h][v]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v)
      _mm256_storeu_ps(out + h * D + 8 * v, _mm256_mul_ps(acc[h][v], _mm256_set1_ps(inv_sum[h])));
}

// In place s[t] = exp(s[t] - max s); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  float mx = reduce_max8(m);
  for (int64_t i = t; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = reduce_add8(sum);
  for (; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}

// Heads per chunk: as many as the AVX-512 build (4 at head_dim 64, 2 at 128,
// 1 at 256), although G * D / 8 accumulators then exceed the 16 ymm registers:
// spilled accumulators stay in L1, and each K/V row is still read once per
// chunk. Measured at head_dim 64, group 3, fp32 (bench/decode_attention.py,
// AMD EPYC 2 vCPUs): 3 heads per chunk 20-27% faster than 1 at batch 32-64.
template <int D>
constexpr int kMaxChunk = (256 / D) > 0 ? (256 / D) : 1;
