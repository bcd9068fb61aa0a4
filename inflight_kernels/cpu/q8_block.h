// Q8_0 rounding of one block of 32 float32 activations (llama.cpp's Q8_0 block,
// ggml-quants.c quantize_row_q8_0: d = max|v| / 127, q = round(v * (1 / d))),
// shared by the int8 GEMMs: q8_gemm.cpp (Q8_0 weights) and q4_gemm.cpp (Q4_1 weights),
// and their store of a tile of 8 output columns.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace q8_block {

constexpr int64_t kBlock = 32;  // values per scale

// One block of 32 floats: returns d, writes q = round(v * (1 / d)),
// as ggml's quantize_row_q8_0 (the oracle, inflight_kernels.reference.q8_0_round, too).
#if defined(__AVX2__)
// With `offset`, q + 128 is stored instead (the VNNI kernel's unsigned activations).
inline float quantize_block(const float* v, int8_t* q, bool offset) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_loadu_ps(v + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = std::max(_mm_cvtss_f32(h), 1e-12f) / 127.0f;
  const __m256 id = _mm256_set1_ps(1.0f / d);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i w[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(a[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    w[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
  }
  // packs work within 128-bit lanes; the permute puts the 8 groups of 4 back in order.
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
  if (offset) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(char(0x80)));  // q + 128 as u8
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}
#else
inline float quantize_block(const float* v, int8_t* q, bool offset) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = std::max(amax, 1e-12f) / 127.0f, id = 1.0f / d;
  for (int64_t i = 0; i < kBlock; ++i) {
    const float r = std::nearbyint(v[i] * id);
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
    if (offset) q[i] = static_cast<int8_t>(uint8_t(q[i]) ^ 0x80u);
  }
  return d;
}
#endif

#if defined(__AVX2__)
// Store the first ncols (1..8) of each of R rows' 8-column accumulators at out + r * out_stride:
// a tile of 8 output columns, the last tile of a weight possibly partial.
template <int R>
inline void store_tile(const __m256* acc, float* out, int64_t out_stride, int64_t ncols) {
  for (int r = 0; r < R; ++r) {
    if (ncols == 8) {
      _mm256_storeu_ps(out + r * out_stride, acc[r]);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[r]);
      std::memcpy(out + r * out_stride, tmp, ncols * sizeof(float));
    }
  }
}
#endif

}  // namespace q8_block
