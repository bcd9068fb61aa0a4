// The bfloat16 micro-kernel shared by bf16_gemm.cpp (weights packed once) and kquant_gemm.cpp
// (K-quant blocks dequantized into the same tiles per step): R activation rows times T tiles
// of 16 output columns, float32 sums, for CPUs with AVX-512 BF16.
//
// Tile layout: for each pair of inputs (k, k + 1), 64 bytes hold (w[c][k], w[c][k + 1]) for the
// tile's 16 columns c, so one zmm load meets a broadcast of the activation pair (x[k], x[k + 1])
// and vdpbf16ps (Intel Intrinsics Guide, _mm512_dpbf16_ps) adds both products into column c's
// lane. Each output sums its products pair by pair in k order whatever R, T and the blocking
// around the call, so a row's result does not depend on the other rows of its batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define INFLIGHT_BF16_MICRO 1
#endif

namespace bf16_micro {

constexpr int64_t kCols = 16;                // output columns per tile (one zmm of float32)
constexpr int64_t kPairBytes = kCols * 2 * 2;  // 16 columns x (k, k + 1) bf16 = 64 bytes

#if defined(INFLIGHT_BF16_MICRO)
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Where micro stores its sums: bfloat16 (rounded once) or float32, rows os elements apart;
// `accumulate` (float32 only): the sums start from out's values instead of zero, so a product
// over K can be split into runs of pairs whose sums still follow the pairs' order.
struct Out {
  void* data;
  bool float32;
  int64_t os;
  bool accumulate = false;
};

// out[r][c] for R rows x T tiles: sums over every pair, then bias, then one bf16 rounding
// (none for a float32 out). Never inlined: inlined into kquant_bf16.h's large loop, GCC 12 kept
// the accumulators on the stack and stored them every pair (3x slower, Zen 4).
template <int R, int T>
__attribute__((noinline)) void micro(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t tile_stride, int64_t pairs, const float* bias,
           Out out, int64_t ncols) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const int64_t left = std::min<int64_t>(kCols, ncols - t * kCols);
      const __mmask16 mask = left >= kCols ? static_cast<__mmask16>(0xFFFF)
                             : left <= 0   ? static_cast<__mmask16>(0)
                                           : static_cast<__mmask16>((1u << left) - 1);
      acc[r][t] = out.accumulate
                      ? _mm512_maskz_loadu_ps(mask, static_cast<const float*>(out.data) + r * out.os + t * kCols)
                      : _mm512_setzero_ps();
    }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wt[T];
    for (int t = 0; t < T; ++t)
      wt[t] = _mm512_loadu_si512(reinterpret_cast<const void*>(w + t * tile_stride + p * (kPairBytes / 2)));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * p, 4);
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(wt[t]), as_bh(xb));
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t left = std::min<int64_t>(kCols, ncols - t * kCols);
    if (left <= 0) break;
    const __mmask16 mask = left == kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + t * kCols) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(acc[r][t], b);
      const int64_t at = r * out.os + t * kCols;
      if (out.float32) _mm512_mask_storeu_ps(static_cast<float*>(out.data) + at, mask, sum);
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + at, mask, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

template <int R>
void micro_tiles(int tiles, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t tile_stride, int64_t pairs,
                 const float* bias, Out out, int64_t ncols) {
  switch (tiles) {
    case 4: return micro<R, 4>(x, xs, w, tile_stride, pairs, bias, out, ncols);
    case 3: return micro<R, 3>(x, xs, w, tile_stride, pairs, bias, out, ncols);
    case 2: return micro<R, 2>(x, xs, w, tile_stride, pairs, bias, out, ncols);
    default: return micro<R, 1>(x, xs, w, tile_stride, pairs, bias, out, ncols);
  }
}

inline void micro_any(int rows, int tiles, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t tile_stride,
               int64_t pairs, const float* bias, Out out, int64_t ncols) {
  switch (rows) {
    case 4: return micro_tiles<4>(tiles, x, xs, w, tile_stride, pairs, bias, out, ncols);
    case 3: return micro_tiles<3>(tiles, x, xs, w, tile_stride, pairs, bias, out, ncols);
    case 2: return micro_tiles<2>(tiles, x, xs, w, tile_stride, pairs, bias, out, ncols);
    default: return micro_tiles<1>(tiles, x, xs, w, tile_stride, pairs, bias, out, ncols);
  }
}
#endif

}  // namespace bf16_micro
