// Q8_0 x Q8_0 linear layer for the CPU: y = x @ W.T with W and x both rounded
// to int8, one float32 scale per 32 consecutive values along the reduction
// dimension (llama.cpp's Q8_0 block, ggml-quants.c: d = max|v| / 127,
// q = round(v * (1 / d))). Per-token or per-tensor activation scales were measured
// to move SmolLM2-135M's next-token distribution many times more than this
// (bench/quant_accuracy.py, bench/RESULTS.md run 15).
//
// Weights are packed once into tiles of 8 output columns: for each 32-value
// block, 8 registers of 32 bytes, register j holding k = 4j..4j+3 of each of
// the 8 columns, so one broadcast of 4 activation bytes meets 8 columns.
// Products use the AVX2 sign trick of ggml's q8_0 dot product:
// maddubs(|w|, sign(x, w)) sums pairs of w*x into int16 without saturation
// (|w|, |x| <= 127, so a pair is at most 32258), madd with ones widens to
// int32; each block's int32 sum is scaled by d_x * d_w into a float32
// accumulator. With AVX-512 VNNI (and VL) one vpdpbusd replaces the sign, maddubs,
// madd and add: it takes unsigned times signed bytes, so the activations are
// stored as q + 128 (u8) and each (tile, block) carries its columns' -128 * sum(w)
// to start the int32 sums with (the zero-point compensation of oneDNN's u8s8
// GEMMs): sum((x + 128) w) - 128 sum(w) = sum(x w), exactly. CPUs without AVX2
// run the same arithmetic in scalar code.

#include "aten_headers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "packed_tiles.h"
#include "q8_block.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INFLIGHT_Q8_VNNI 1
constexpr bool kUnsignedActivations = true;  // activations stored as q + 128
#else
constexpr bool kUnsignedActivations = false;
#endif

namespace {

using q8_block::kBlock;        // values per scale (Q8_0)
using q8_block::quantize_block;
using packed_tiles::kCols;  // output columns per packed tile
constexpr int64_t kTileWeightBytes = packed_tiles::kQ8TileWeightBytes;  // 256 int8 weights per (tile, block)
// then 8 int32: -128 * sum of the block's weights per column (VNNI's compensation)
constexpr int64_t kTileBlockBytes = packed_tiles::kQ8TileBlockBytes;
#if defined(INFLIGHT_Q8_VNNI)
constexpr int kRows = 8;  // activation rows per micro-kernel call (32 ymm registers; 4 and 6 were slower)
#else
constexpr int kRows = 4;          // activation rows per micro-kernel call (16 ymm registers)
#endif
constexpr int64_t kRowBlock = 64; // activation rows per pass over the weights (kept in L1/L2)

// Per 8-column tile t and block b: col c's value k = 4j + i sits at byte j*32 + c*4 + i.
inline int64_t packed_offset(int64_t c, int64_t i) { return (i / 4) * 32 + c * 4 + (i % 4); }

#if defined(__AVX2__)
// isum[r] lane c = the int32 dot product of row r's block (xb + r * x_stride) with
// column c's block of the tile (wb).
template <int R>
inline void block_sums(const int8_t* xb, int64_t x_stride, const int8_t* wb, __m256i* isum) {
#if defined(INFLIGHT_Q8_VNNI)
  // xb holds qx + 128: start from the block's -128 * sum(w), stored after its weights.
  const __m256i compensation = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kTileWeightBytes));
  for (int r = 0; r < R; ++r) isum[r] = compensation;
  for (int j = 0; j < 8; ++j) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * 32));
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xb + r * x_stride + j * 4, 4);
      isum[r] = _mm256_dpbusd_epi32(isum[r], _mm256_set1_epi32(four), w);
    }
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * 32));
    const __m256i w_abs = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xb + r * x_stride + j * 4, 4);
      const __m256i x_signed = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
      const __m256i pairs = _mm256_maddubs_epi16(w_abs, x_signed);
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
    }
  }
#endif
}

// out[r][0..ncols) = sum over blocks of d_x[r] d_w * (qx[r] . qw) for R rows.
template <int R>
void tile_rows(const int8_t* xq, const float* xd, int64_t k_blocks, const int8_t* wq, const float* wd,
               float* out, int64_t out_stride, int64_t ncols) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t x_stride = k_blocks * kBlock;
  for (int64_t b = 0; b < k_blocks; ++b) {
    __m256i isum[R];
    block_sums<R>(xq + b * kBlock, x_stride, wq + b * kTileBlockBytes, isum);
    const __m256 dw = _mm256_loadu_ps(wd + b * kCols);
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * k_blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
    }
  }
  q8_block::store_tile<R>(acc, out, out_stride, ncols);
}
#else
template <int R>
void tile_rows(const int8_t* xq, const float* xd, int64_t k_blocks, const int8_t* wq, const float* wd,
               float* out, int64_t out_stride, int64_t ncols) {
  const int64_t x_stride = k_blocks * kBlock;
  for (int r = 0; r < R; ++r) {
    float acc[kCols] = {0};
    for (int64_t b = 0; b < k_blocks; ++b) {
      for (int64_t c = 0; c < kCols; ++c) {
        int32_t s = 0;
        for (int64_t i = 0; i < kBlock; ++i)
          s += int32_t(xq[r * x_stride + b * kBlock + i]) * int32_t(wq[b * kTileBlockBytes + packed_offset(c, i)]);
        acc[c] += float(s) * (wd[b * kCols + c] * xd[r * k_blocks + b]);
      }
    }
    std::memcpy(out + r * out_stride, acc, ncols * sizeof(float));
  }
}
#endif

// The last m % kRows rows of a pass (fewer than kRows).
template <int R = kRows - 1>
void tail_rows(int64_t left, const int8_t* xq, const float* xd, int64_t k_blocks, const int8_t* wq, const float* wd,
               float* out, int64_t out_stride, int64_t ncols) {
  if constexpr (R > 0) {
    if (left == R) tile_rows<R>(xq, xd, k_blocks, wq, wd, out, out_stride, ncols);
    else tail_rows<R - 1>(left, xq, xd, k_blocks, wq, wd, out, out_stride, ncols);
  }
}

void check_weight(const at::Tensor& qw, const at::Tensor& dw) {
  TORCH_CHECK(qw.scalar_type() == at::kChar && qw.dim() == 3 && qw.size(2) == kTileBlockBytes && qw.is_contiguous(),
              "q8: packed weight must be int8 [tiles, blocks, 288], contiguous");
  TORCH_CHECK(dw.scalar_type() == at::kFloat && dw.dim() == 3 && dw.size(0) == qw.size(0) &&
                  dw.size(1) == qw.size(1) && dw.size(2) == kCols && dw.is_contiguous(),
              "q8: weight scales must be float32 [tiles, blocks, 8], contiguous");
}

}  // namespace

// w float32 [N, K] (K a multiple of 32) -> (int8 [ceil(N/8), K/32, 288], float32 [ceil(N/8), K/32, 8]);
// per (tile, block): 256 weight bytes (packed_offset), then 8 int32 compensations (-128 * sum per column);
// padding columns are zero.
std::vector<at::Tensor> q8_pack_weight(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "q8_pack_weight: w must be float32 [N, K]");
  TORCH_CHECK(w.size(1) % kBlock == 0, "q8_pack_weight: K=", w.size(1), " is not a multiple of 32");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = k / kBlock, tiles = (n + kCols - 1) / kCols;
  at::Tensor qw = at::zeros({tiles, blocks, kTileBlockBytes}, at::kChar);
  at::Tensor dw = at::zeros({tiles, blocks, kCols}, at::kFloat);
  const float* wp = w.data_ptr<float>();
  int8_t* qp = qw.data_ptr<int8_t>();
  float* dp = dw.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t first, int64_t last) {
    int8_t q[kBlock];
    for (int64_t row = first; row < last; ++row) {
      const int64_t t = row / kCols, c = row % kCols;
      for (int64_t b = 0; b < blocks; ++b) {
        dp[(t * blocks + b) * kCols + c] = quantize_block(wp + row * k + b * kBlock, q, false);
        int8_t* dst = qp + (t * blocks + b) * kTileBlockBytes;
        int32_t sum = 0;
        for (int64_t i = 0; i < kBlock; ++i) {
          dst[packed_offset(c, i)] = q[i];
          sum += q[i];
        }
        const int32_t compensation = -128 * sum;
        std::memcpy(dst + kTileWeightBytes + c * 4, &compensation, 4);
      }
    }
  });
  return {qw, dw};
}

// out float32 [M, N] = Q8_0(x) @ Q8_0(W).T for x float32 [M, K] with contiguous rows.
void q8_linear(at::Tensor out, at::Tensor x, at::Tensor qw, at::Tensor dw) {
  check_weight(qw, dw);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "q8_linear: x must be float32 [M, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "q8_linear: out must be float32 [M, N] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), blocks = qw.size(1), tiles = qw.size(0);
  TORCH_CHECK(k == blocks * kBlock && (n + kCols - 1) / kCols == tiles, "q8_linear: shapes disagree: x ", x.sizes(),
              ", out ", out.sizes(), ", packed ", qw.sizes());
  at::Tensor xq = at::empty({m, k}, at::kChar);
  at::Tensor xd = at::empty({m, blocks}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t b = 0; b < blocks; ++b) xdp[r * blocks + b] = quantize_block(xp + r * xs + b * kBlock, xqp + r * k + b * kBlock, kUnsignedActivations);
  });
  const int8_t* wq = qw.data_ptr<int8_t>();
  const float* wd = dw.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    at::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        const int8_t* tw = wq + t * blocks * kTileBlockBytes;
        const float* td = wd + t * blocks * kCols;
        const int64_t ncols = std::min(kCols, n - t * kCols);
        int64_t r = m0;
        for (; r + kRows <= m1; r += kRows)
          tile_rows<kRows>(xqp + r * k, xdp + r * blocks, blocks, tw, td, op + r * os + t * kCols, os, ncols);
        const int64_t left = m1 - r;
        const int8_t* rq = xqp + r * k;
        const float* rd = xdp + r * blocks;
        float* ro = op + r * os + t * kCols;
        tail_rows(left, rq, rd, blocks, tw, td, ro, os, ncols);
      }
    });
  }
}
