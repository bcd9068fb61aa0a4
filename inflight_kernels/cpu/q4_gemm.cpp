// Q4_1 x Q8_0 linear layer for the CPU: y = x @ W.T with W in llama.cpp's Q4_1
// blocks and x rounded to Q8_0 blocks at run time (q8_block.h), as ggml's
// ggml_vec_dot_q4_1_q8_1 computes it. A Q4_1 block holds 32 consecutive values
// along the reduction dimension as 4-bit q in [0, 15] with an fp16 scale d and an
// fp16 minimum m, w = d q + m (ggml-quants.c quantize_row_q4_1_ref: m = min(v),
// d = (max(v) - m) / 15, q = min(15, (int)((v - m) / d + 0.5))). So
//   sum_k w_k x_k = d_w d_x sum_k q_k qx_k + m_w (d_x sum_k qx_k)
// with one int8 dot product per block and the activations' block sums (ggml's
// Q8_1 "s") computed once per row.
//
// Re-quantizing weights that were dequantized from Q4_1 gives back the same
// blocks (each block holds its minimum at q = 0 and its maximum at q = 15), so a
// Q4_1 GGUF runs on its own weights, 5 bits per value: a decode step at batch 1
// reads 0.625 bytes per parameter where bfloat16 reads 2 and Q8_0 1.125.
//
// Packing: tiles of 8 output columns, as q8_gemm.cpp. Per (tile, block) 160 bytes:
// 4 registers of 32 bytes, register j holding, for column c at bytes 4c..4c+3, the
// values k = 8j + i in the low nibbles and k = 8j + 4 + i in the high nibbles
// (i = 0..3); then the 8 columns' d (fp16), then their m (fp16), 20 bytes per
// column and block like the GGUF's own blocks. Unpacking a register with a mask
// and a 4-bit shift gives two registers lined up with broadcasts of 4 activation
// bytes, and maddubs (unsigned q times signed activations) sums pairs without
// saturation (2 * 15 * 127 = 3810; eight of them still fit int16). CPUs without
// AVX2 run the same arithmetic in scalar code.

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

namespace {

using q8_block::kBlock;
using q8_block::quantize_block;
using packed_tiles::kCols;                               // output columns per packed tile
constexpr int64_t kNibbleBytes = packed_tiles::kQ4NibbleBytes;        // 128 bytes of 4-bit values per (tile, block)
constexpr int64_t kTileBlockBytes = packed_tiles::kQ4TileBlockBytes;  // then 8 fp16 d, then 8 fp16 m
constexpr int kRows = 4;                                 // activation rows per micro-kernel call
constexpr int64_t kRowBlock = 64;                        // activation rows per pass over the weights

// Byte of value k of column c within a (tile, block), and whether it is the high nibble.
inline int64_t nibble_byte(int64_t c, int64_t k) { return (k / 8) * 32 + c * 4 + (k % 4); }
inline bool high_nibble(int64_t k) { return (k % 8) >= 4; }

using packed_tiles::from_half;
using packed_tiles::to_half;

// Q4_1 of one block of 32 floats (quantize_row_q4_1_ref): q[0..32), returns (d, m) rounded to fp16.
inline void quantize_q4_1(const float* v, uint8_t* q, uint16_t* d_half, uint16_t* m_half) {
  float lo = v[0], hi = v[0];
  for (int64_t i = 1; i < kBlock; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  const float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < kBlock; ++i)
    q[i] = static_cast<uint8_t>(std::min(15, static_cast<int>((v[i] - lo) * id + 0.5f)));
  *d_half = to_half(d);
  *m_half = to_half(lo);
}

#if defined(__AVX2__)
// acc[r] (8 columns) += this block's d_w d_x sum(q qx) + m_w s_x for R rows.
template <int R>
inline void block_rows(const int8_t* xb, int64_t x_stride, const float* xd, const float* xs, const uint8_t* wb,
                       __m256* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
    const __m256i q_lo = _mm256_and_si256(v, low);
    const __m256i q_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    for (int r = 0; r < R; ++r) {
      int32_t first, second;
      std::memcpy(&first, xb + r * x_stride + 8 * j, 4);
      std::memcpy(&second, xb + r * x_stride + 8 * j + 4, 4);
      sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(q_lo, _mm256_set1_epi32(first)));
      sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(q_hi, _mm256_set1_epi32(second)));
    }
  }
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kNibbleBytes)));
  const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kNibbleBytes + 16)));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
    acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xd[r])), acc[r]);
    acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r]), acc[r]);
  }
}

// out[r][0..ncols) = x_r . w_c over all blocks for R rows (xd, xs: [R, k_blocks]).
template <int R>
void tile_rows(const int8_t* xq, const float* xd, const float* xs, int64_t k_blocks, const uint8_t* wq, float* out,
               int64_t out_stride, int64_t ncols) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t x_stride = k_blocks * kBlock;
  for (int64_t b = 0; b < k_blocks; ++b) {
    float db[R], sb[R];
    for (int r = 0; r < R; ++r) {
      db[r] = xd[r * k_blocks + b];
      sb[r] = xs[r * k_blocks + b];
    }
    block_rows<R>(xq + b * kBlock, x_stride, db, sb, wq + b * kTileBlockBytes, acc);
  }
  q8_block::store_tile<R>(acc, out, out_stride, ncols);
}
#else
template <int R>
void tile_rows(const int8_t* xq, const float* xd, const float* xs, int64_t k_blocks, const uint8_t* wq, float* out,
               int64_t out_stride, int64_t ncols) {
  const int64_t x_stride = k_blocks * kBlock;
  for (int r = 0; r < R; ++r) {
    float acc[kCols] = {0};
    for (int64_t b = 0; b < k_blocks; ++b) {
      const uint8_t* wb = wq + b * kTileBlockBytes;
      uint16_t dh[kCols], mh[kCols];
      std::memcpy(dh, wb + kNibbleBytes, sizeof(dh));
      std::memcpy(mh, wb + kNibbleBytes + 16, sizeof(mh));
      for (int64_t c = 0; c < kCols; ++c) {
        int32_t s = 0;
        for (int64_t k = 0; k < kBlock; ++k) {
          const uint8_t byte = wb[nibble_byte(c, k)];
          const int32_t q = high_nibble(k) ? byte >> 4 : byte & 0x0F;
          s += q * int32_t(xq[r * x_stride + b * kBlock + k]);
        }
        acc[c] += float(s) * (from_half(dh[c]) * xd[r * k_blocks + b]) + from_half(mh[c]) * xs[r * k_blocks + b];
      }
    }
    std::memcpy(out + r * out_stride, acc, ncols * sizeof(float));
  }
}
#endif

// The last m % kRows rows of a pass (fewer than kRows).
template <int R = kRows - 1>
void tail_rows(int64_t left, const int8_t* xq, const float* xd, const float* xs, int64_t k_blocks, const uint8_t* wq,
               float* out, int64_t out_stride, int64_t ncols) {
  if constexpr (R > 0) {
    if (left == R) tile_rows<R>(xq, xd, xs, k_blocks, wq, out, out_stride, ncols);
    else tail_rows<R - 1>(left, xq, xd, xs, k_blocks, wq, out, out_stride, ncols);
  }
}

}  // namespace

// w float32 [N, K] (K a multiple of 32) -> uint8 [ceil(N/8), K/32, 160] (the layout above;
// padding columns are zero).
at::Tensor q4_1_pack_weight(at::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "q4_1_pack_weight: w must be a CPU float32 [N, K]");
  TORCH_CHECK(w.size(1) % kBlock == 0, "q4_1_pack_weight: K=", w.size(1), " is not a multiple of 32");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = k / kBlock, tiles = (n + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({tiles, blocks, kTileBlockBytes}, at::kByte);
  const float* wp = w.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  // One task per tile: the 8 columns of a tile share bytes.
  at::parallel_for(0, tiles, 8, [&](int64_t first, int64_t last) {
    uint8_t q[kBlock];
    for (int64_t t = first; t < last; ++t) {
      for (int64_t c = 0; c < std::min(kCols, n - t * kCols); ++c) {
        const float* row = wp + (t * kCols + c) * k;
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* dst = pp + (t * blocks + b) * kTileBlockBytes;
          uint16_t d, m;
          quantize_q4_1(row + b * kBlock, q, &d, &m);
          for (int64_t i = 0; i < kBlock; ++i)
            dst[nibble_byte(c, i)] |= high_nibble(i) ? uint8_t(q[i] << 4) : q[i];
          std::memcpy(dst + kNibbleBytes + 2 * c, &d, 2);
          std::memcpy(dst + kNibbleBytes + 16 + 2 * c, &m, 2);
        }
      }
    }
  });
  return packed;
}

// out float32 [M, N] = Q8_0(x) @ Q4_1(W).T for x float32 [M, K] with contiguous rows.
void q4_1_linear(at::Tensor out, at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == kTileBlockBytes && packed.is_contiguous(),
              "q4_1_linear: packed weight must be a contiguous CPU uint8 [tiles, blocks, 160]");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "q4_1_linear: x must be a CPU float32 [M, K] with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "q4_1_linear: out must be a CPU float32 [M, N] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), blocks = packed.size(1), tiles = packed.size(0);
  TORCH_CHECK(k == blocks * kBlock && (n + kCols - 1) / kCols == tiles, "q4_1_linear: shapes disagree: x ", x.sizes(),
              ", out ", out.sizes(), ", packed ", packed.sizes());
  at::Tensor xq = at::empty({m, k}, at::kChar);
  at::Tensor xd = at::empty({m, blocks}, at::kFloat);
  at::Tensor xs = at::empty({m, blocks}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  const int64_t x_stride = x.stride(0), os = out.stride(0);
  at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        int8_t* q = xqp + r * k + b * kBlock;
        const float d = quantize_block(xp + r * x_stride + b * kBlock, q, false);
        int32_t sum = 0;
        for (int64_t i = 0; i < kBlock; ++i) sum += q[i];
        xdp[r * blocks + b] = d;
        xsp[r * blocks + b] = d * float(sum);
      }
    }
  });
  const uint8_t* wq = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    at::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        const uint8_t* tw = wq + t * blocks * kTileBlockBytes;
        const int64_t ncols = std::min(kCols, n - t * kCols);
        int64_t r = m0;
        for (; r + kRows <= m1; r += kRows)
          tile_rows<kRows>(xqp + r * k, xdp + r * blocks, xsp + r * blocks, blocks, tw, op + r * os + t * kCols, os,
                           ncols);
        tail_rows(m1 - r, xqp + r * k, xdp + r * blocks, xsp + r * blocks, blocks, tw, op + r * os + t * kCols, os,
                  ncols);
      }
    });
  }
}
