// AVX-512 (F/BW/VL/DQ) vector of 16 floats for the paged decode attention
// (attention_simd.h holds the loops). Included by paged_attention.cpp inside its
// namespace.
#pragma once

struct Simd {
  using R = __m512;
  static constexpr int W = 16;  // lanes
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R loadu(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
  static void storeu(float* p, R v) { _mm512_storeu_ps(p, v); }
  static void store(float* p, R v) { _mm512_store_ps(p, v); }
  // 16 floats from 16 elements of the cache dtype.
  static R from(const float* p) { return _mm512_loadu_ps(p); }
  static R from(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static R from(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(R v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(R v) { return _mm512_reduce_max_ps(v); }

  static R min(R a, R b) { return _mm512_min_ps(a, b); }
  static R round(R x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static R ldexp(R p, R n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

  // Lane L of row_sums(v) = sum of the 16 lanes of v[L] (v is clobbered). Four
  // halving steps (segment halves 8, 4, 2, 1); each adds the two halves of every
  // segment of a pair (x, y), picked by permutex2var (index 16+ = from y).
  static R row_sums(R* v) {
    for (int step = 0, n = W; step < 4; ++step, n /= 2)
      for (int i = 0; i < n / 2; ++i) v[i] = combine(v[2 * i], v[2 * i + 1], step);
    return v[0];
  }
  static R combine(R x, R y, int step) {
    alignas(64) static const int32_t kHalves[4][2][16] = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
         {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
        {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
         {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
        {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
         {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};
    return _mm512_add_ps(_mm512_permutex2var_ps(x, _mm512_load_si512(kHalves[step][0]), y),
                         _mm512_permutex2var_ps(x, _mm512_load_si512(kHalves[step][1]), y));
  }
};
