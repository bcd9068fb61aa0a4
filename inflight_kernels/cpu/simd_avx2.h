// AVX2 + FMA + F16C vector of 8 floats for the paged decode attention
// (attention_simd.h holds the loops), for CPUs without AVX-512 (AMD Zen 1-3,
// Intel before Skylake-SP, most laptops). Included by paged_attention.cpp inside
// its namespace.
#pragma once

struct Simd {
  using R = __m256;
  static constexpr int W = 8;  // lanes
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R loadu(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
  static void storeu(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void store(float* p, R v) { _mm256_store_ps(p, v); }
  // 8 floats from 8 elements of the cache dtype.
  static R from(const float* p) { return _mm256_loadu_ps(p); }
  static R from(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static R from(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(R v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(R v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }

  static R min(R a, R b) { return _mm256_min_ps(a, b); }
  static R round(R x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static R ldexp(R p, R n) {  // p * 2^n, n integral in [-126, 127]: 2^n built in the exponent bits
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }

  // Lane L of row_sums(v) = sum of the 8 lanes of v[L]: two rounds of hadd give
  // each 128-bit half's partial sums of four rows, then the halves add.
  static R row_sums(const R* v) {
    const R a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const R b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
};
