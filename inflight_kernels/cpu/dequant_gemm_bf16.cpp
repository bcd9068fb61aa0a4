// The weight-only linear layers of dequant_gemm.cpp (Q4_1 and Q8_0 weights) with the
// activations rounded to bfloat16, for CPUs with AVX-512 BF16: x is rounded once per call
// and multiplied by the blocks' integers with vdpbf16ps, 32 products per instruction where
// a float32 FMA makes 16. The weights stay in q4_gemm.cpp's and q8_gemm.cpp's packed tiles
// and are used exactly.
//
// Why: from a few rows on the float32 path is bound by FMA throughput (about 8.6 GFLOP per
// SmolLM2-135M step at 32 rows); on an AVX-512 BF16 EPYC this path made the projections
// faster at every row count (bench/RESULTS.md run 30). Multiplying in the
// activations' 16-bit dtype is what vLLM's GGUF kernels do on GPUs.
//
// Exactness of the products: each integer is carried in bfloat16 exactly, with an offset of
// 128 (Q4_1: 128 + q as the bits 0x4300 | q; Q8_0: q + 128, 0..255, through float32), and its
// product with a bfloat16 activation is exact in float32. The offset comes back out through
// the block's sum of the rounded activations, one more FMA per block and row:
//   Q4_1 (w = d q + m): sum w x~ = d sum (128 + q) x~ + (m - 128 d) sum x~
//   Q8_0 (w = d q):     sum w x~ = d sum (q + 128) x~ - 128 d sum x~
// Each row is computed alone, in the same order whatever the row count and the column
// blocking, so a row's result does not depend on its batch (batch-invariant like the
// float32 path, with other results than it).
//
// Source of the instruction semantics: Intel Intrinsics Guide, _mm512_dpbf16_ps,
// _mm512_cvtneps_pbh (round to nearest even), _mm512_mask_shuffle_epi8.

#include "aten_headers.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "packed_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define INFLIGHT_DEQUANT_BF16 1
#endif

namespace {

using packed_tiles::kBlock;
using packed_tiles::kCols;

#if defined(INFLIGHT_DEQUANT_BF16)
constexpr int kRows = 8;            // rows per micro-kernel
// groups of two tiles per micro-kernel with many rows: 16 independent vdpbf16ps chains (8 left the
// latency exposed: 2 groups were 1.24x faster than 1 at 32 and 64 rows on the AVX-512 BF16 EPYC of
// bench/RESULTS.md run 30; 4 rows x 4 groups and 6 x 2 were between)
constexpr int kWideGroups = 2;
constexpr int64_t kRowBlock = 64;   // activation rows per pass over the weights
constexpr int kChains = 4;          // groups of two tiles one row runs at once when the rows are few
constexpr int64_t kFewRows = 4;     // fewer rows per pass than this run one at a time over kChains groups
constexpr uint16_t kOffsetBits = 0x4300;  // bfloat16 128.0; | q gives 128 + q for q < 128
constexpr float kOffset = 128.0f;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// pshufb control (within each 128-bit lane) putting bytes B and B + 1 of every int32 lane at
// its bytes 0 and 2, the low bytes of its two 16-bit words.
template <int B>
inline __m512i pair_control() {
  const __m128i c = _mm_setr_epi8(B, -1, B + 1, -1, 4 + B, -1, 5 + B, -1, 8 + B, -1, 9 + B, -1, 12 + B, -1,
                                  13 + B, -1);
  return _mm512_broadcast_i32x4(c);
}

// pshufb control taking byte B of every int32 lane to its bottom byte, zeroing the other three.
template <int B>
inline __m512i byte_control() {
  const __m128i c = _mm_setr_epi8(B, -1, -1, -1, 4 + B, -1, -1, -1, 8 + B, -1, -1, -1, 12 + B, -1, -1, -1);
  return _mm512_broadcast_i32x4(c);
}

// Two adjacent tiles' 32 bytes at p (tile_bytes apart): tile t in lanes 0..7, tile t + 1 in lanes
// 8..15 (zero when t is the last tile).
inline __m512i load_pair(const uint8_t* p, int64_t tile_bytes, bool partner) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = partner ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + tile_bytes))
                             : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

inline __m512 halves_pair(const uint8_t* p, int64_t tile_bytes, bool partner) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = partner ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + tile_bytes)) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

inline __m512 floats_pair(const float* p, int64_t tile_floats, bool partner) {
  const __m256 hi = partner ? _mm256_loadu_ps(p + tile_floats) : _mm256_setzero_ps();
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), hi, 1);
}

// Q4_1 tiles (packed_tiles.h): 4 registers per block; byte i of column c's int32 lane in register
// j holds q of inputs 8j + i (low nibble) and 8j + 4 + i (high nibble), 0..15, carried as the
// bfloat16 128 + q (bits 0x4300 | q, exact). Per block and column: w = d q + m, so
// sum w x~ = d sum (128 + q) x~ + (m - 128 d) sum x~.
struct Q4 {
  static constexpr int kRegisters = 4, kPairs = 4, kInputs = 8;  // per register
  static constexpr int64_t kTileBlockBytes = packed_tiles::kQ4TileBlockBytes;
  // w[p]: the bfloat16 pairs of inputs (kInputs j + 2p, + 1) of the 16 columns
  static void decode(__m512i v, __m512i* w) {
    const __m512i offset = _mm512_set1_epi16(static_cast<int16_t>(kOffsetBits));
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __mmask64 low_bytes = 0x5555555555555555ull;
    const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    w[0] = _mm512_mask_shuffle_epi8(offset, low_bytes, lo, pair_control<0>());  // inputs 8j, 8j + 1
    w[1] = _mm512_mask_shuffle_epi8(offset, low_bytes, lo, pair_control<2>());  // 8j + 2, 8j + 3
    w[2] = _mm512_mask_shuffle_epi8(offset, low_bytes, hi, pair_control<0>());  // 8j + 4, 8j + 5
    w[3] = _mm512_mask_shuffle_epi8(offset, low_bytes, hi, pair_control<2>());  // 8j + 6, 8j + 7
  }
  // d and the sum-of-x~ coefficient (m - 128 d) of block b's 16 columns
  static void scales(const uint8_t* gb, const float*, int64_t tile_bytes, int64_t, bool partner, __m512* d,
                     __m512* c) {
    *d = halves_pair(gb + packed_tiles::kQ4NibbleBytes, tile_bytes, partner);
    const __m512 m = halves_pair(gb + packed_tiles::kQ4NibbleBytes + 16, tile_bytes, partner);
    *c = _mm512_fnmadd_ps(_mm512_set1_ps(kOffset), *d, m);
  }
};

// Q8_0 tiles (packed_tiles.h): 8 registers per block; byte i of column c's int32 lane in register
// j holds the int8 q of input 4j + i. q + 128 (the byte with its top bit flipped, 0..255) is exact
// in bfloat16 (8 significant bits): converted through float32, whose top 16 bits it is. Per block
// and column: w = d q, so sum w x~ = d sum (q + 128) x~ - 128 d sum x~.
struct Q8 {
  static constexpr int kRegisters = 8, kPairs = 2, kInputs = 4;
  static constexpr int64_t kTileBlockBytes = packed_tiles::kQ8TileBlockBytes;
  static void decode(__m512i v, __m512i* w) {
    const __m512i u = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __mmask32 odd_words = 0xAAAAAAAAu;
    const __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(u, byte_control<0>())));
    const __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(u, byte_control<1>())));
    const __m512i f2 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(u, byte_control<2>())));
    const __m512i f3 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srli_epi32(u, 24)));
    w[0] = _mm512_mask_blend_epi16(odd_words, _mm512_srli_epi32(f0, 16), f1);  // inputs 4j, 4j + 1
    w[1] = _mm512_mask_blend_epi16(odd_words, _mm512_srli_epi32(f2, 16), f3);  // 4j + 2, 4j + 3
  }
  static void scales(const uint8_t*, const float* sb, int64_t, int64_t tile_floats, bool partner, __m512* d,
                     __m512* c) {
    *d = floats_pair(sb, tile_floats, partner);
    *c = _mm512_mul_ps(_mm512_set1_ps(-kOffset), *d);
  }
};

// R rows of rounded activations xb (uint16 bfloat16, xbs apart; xsum their per-block sums) against
// C groups of two tiles of packed F weights at wq (Q8_0: scales at sq; groups 2 tiles apart):
// out[r][0..ncols). With C > 1 every group is full; C > 1 only gives one row independent
// dot-product chains (the latency of vdpbf16ps that R rows hide otherwise): each output lane gets
// the same operations in the same order whatever R and C.
template <class F, int R, int C>
void tile_rows(const uint16_t* xb, int64_t xbs, const float* xsum, int64_t k_blocks, const uint8_t* wq,
               const float* sq, bool partner, float* out, int64_t os, int64_t ncols) {
  const int64_t tile_bytes = k_blocks * F::kTileBlockBytes, tile_floats = k_blocks * kCols;
  __m512 acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k_blocks; ++b) {
    const uint8_t* wb = wq + b * F::kTileBlockBytes;
    __m512 bacc[R * C];
    for (int i = 0; i < R * C; ++i) bacc[i] = _mm512_setzero_ps();
    for (int j = 0; j < F::kRegisters; ++j) {
      __m512i w[C][F::kPairs];
      for (int c = 0; c < C; ++c) F::decode(load_pair(wb + 2 * c * tile_bytes + 32 * j, tile_bytes, partner), w[c]);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xp = xb + r * xbs + b * kBlock + F::kInputs * j;
        for (int p = 0; p < F::kPairs; ++p) {
          int32_t pair;
          std::memcpy(&pair, xp + 2 * p, 4);
          const __m512i xpair = _mm512_set1_epi32(pair);  // one broadcast for the C groups
          for (int c = 0; c < C; ++c)
            bacc[r * C + c] = _mm512_dpbf16_ps(bacc[r * C + c], as_bh(w[c][p]), as_bh(xpair));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      __m512 d, coef;
      F::scales(wb + 2 * c * tile_bytes, sq ? sq + 2 * c * tile_floats + b * kCols : nullptr, tile_bytes, tile_floats,
                partner, &d, &coef);
      for (int r = 0; r < R; ++r) {
        acc[r * C + c] = _mm512_fmadd_ps(bacc[r * C + c], d, acc[r * C + c]);
        acc[r * C + c] = _mm512_fmadd_ps(coef, _mm512_set1_ps(xsum[r * k_blocks + b]), acc[r * C + c]);
      }
    }
  }
  const int64_t last = C > 1 ? 16 : ncols;  // columns of the last group stored
  const __mmask16 mask = last >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << last) - 1);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + r * os + 16 * c, c + 1 < C ? 0xFFFF : mask, acc[r * C + c]);
}

template <class F, int R = kRows - 1>
void tail_rows(int64_t left, const uint16_t* xb, int64_t xbs, const float* xsum, int64_t k_blocks, const uint8_t* wq,
               const float* sq, bool partner, float* out, int64_t os, int64_t ncols) {
  if constexpr (R > 0) {
    if (left == R) tile_rows<F, R, 1>(xb, xbs, xsum, k_blocks, wq, sq, partner, out, os, ncols);
    else tail_rows<F, R - 1>(left, xb, xbs, xsum, k_blocks, wq, sq, partner, out, os, ncols);
  }
}

// x float32 [m, K] (rows xs apart) -> bfloat16 bits [m, K] (round to nearest even) and each row's
// per-block sums of the rounded values, in input order.
void round_rows(const float* x, int64_t xs, int64_t m, int64_t k_blocks, uint16_t* xb, float* xsum) {
  const int64_t k = k_blocks * kBlock;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; i += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * xs + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + r * k + i), (__m256i)h);
    }
    for (int64_t b = 0; b < k_blocks; ++b) {
      float s = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) {
        const uint32_t bits = uint32_t(xb[r * k + b * kBlock + i]) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        s += v;
      }
      xsum[r * k_blocks + b] = s;
    }
  }
}
#endif

}  // namespace

bool dequant_bf16_compiled() {
#if defined(INFLIGHT_DEQUANT_BF16)
  return true;
#else
  return false;
#endif
}

namespace {

#if defined(INFLIGHT_DEQUANT_BF16)
// out [M, N] (rows out_stride apart) = x~ [M, K] @ W.T, x~ the bfloat16 rounding of x, W packed as F.
template <class F>
void dequant_linear_bf16(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t m, int64_t n,
                         int64_t k_blocks, const uint8_t* wq, const float* sq) {
  const int64_t k = k_blocks * kBlock, tiles = (n + kCols - 1) / kCols;
  const int64_t tile_bytes = k_blocks * F::kTileBlockBytes, tile_floats = k_blocks * kCols, groups = (tiles + 1) / 2;
  std::vector<uint16_t> rounded(m * k);
  std::vector<float> sums(m * k_blocks);
  round_rows(x, x_stride, m, k_blocks, rounded.data(), sums.data());
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    at::parallel_for(0, groups, 2, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) {
        const int64_t t = 2 * g, ncols = std::min<int64_t>(2 * kCols, n - t * kCols);
        const bool partner = t + 1 < tiles;
        const uint8_t* tw = wq + t * tile_bytes;
        const float* ts = sq ? sq + t * tile_floats : nullptr;
        float* to = out + t * kCols;
        if (m1 - m0 < kFewRows && g + kChains <= last && (t + 2 * kChains) * kCols <= n) {
          for (int64_t r = m0; r < m1; ++r)
            tile_rows<F, 1, kChains>(rounded.data() + r * k, k, sums.data() + r * k_blocks, k_blocks, tw, ts, true,
                                     to + r * out_stride, out_stride, 2 * kChains * kCols);
          g += kChains - 1;
          continue;
        }
        int64_t r = m0;
        if (g + kWideGroups <= last && (t + 2 * kWideGroups) * kCols <= n) {  // kRows rows x kWideGroups groups
          for (; r + kRows <= m1; r += kRows)
            tile_rows<F, kRows, kWideGroups>(rounded.data() + r * k, k, sums.data() + r * k_blocks, k_blocks, tw, ts,
                                             true, to + r * out_stride, out_stride, 2 * kWideGroups * kCols);
          for (int c = 0; c < kWideGroups && r < m1; ++c)  // the last rows, group by group
            tail_rows<F>(m1 - r, rounded.data() + r * k, k, sums.data() + r * k_blocks, k_blocks,
                         tw + 2 * c * tile_bytes, ts ? ts + 2 * c * tile_floats : nullptr, true,
                         to + 2 * c * kCols + r * out_stride, out_stride, 2 * kCols);
          g += kWideGroups - 1;
          continue;
        }
        for (; r + kRows <= m1; r += kRows)
          tile_rows<F, kRows, 1>(rounded.data() + r * k, k, sums.data() + r * k_blocks, k_blocks, tw, ts, partner,
                                 to + r * out_stride, out_stride, ncols);
        tail_rows<F>(m1 - r, rounded.data() + r * k, k, sums.data() + r * k_blocks, k_blocks, tw, ts, partner,
                     to + r * out_stride, out_stride, ncols);
      }
    });
  }
}
#endif

}  // namespace

void q4_1_dequant_linear_bf16_raw(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t m,
                                  int64_t n, int64_t k_blocks, const uint8_t* wq) {
  TORCH_CHECK(dequant_bf16_compiled(), "q4_1_dequant_linear with bfloat16 activations: built without AVX-512 BF16");
#if defined(INFLIGHT_DEQUANT_BF16)
  dequant_linear_bf16<Q4>(out, out_stride, x, x_stride, m, n, k_blocks, wq, nullptr);
#endif
}

void q8_0_dequant_linear_bf16_raw(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t m,
                                  int64_t n, int64_t k_blocks, const uint8_t* wq, const float* scales) {
  TORCH_CHECK(dequant_bf16_compiled(), "q8_0_dequant_linear with bfloat16 activations: built without AVX-512 BF16");
#if defined(INFLIGHT_DEQUANT_BF16)
  dequant_linear_bf16<Q8>(out, out_stride, x, x_stride, m, n, k_blocks, wq, scales);
#endif
}
