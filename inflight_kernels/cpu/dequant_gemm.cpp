// Weight-only quantized linear layers for the CPU: y = x @ W.T with W in Q4_1 or
// Q8_0 blocks (as packed by q4_gemm.cpp and q8_gemm.cpp) and x kept in float32.
// The weights are dequantized in registers as they stream past, never stored:
// llama.cpp's GGUF blocks run at the file's own bytes per weight (0.625 for Q4_1,
// 1.0625 plus VNNI padding for Q8_0), while the arithmetic is that of float32
// weights, so the next-token distribution is the dequantized model's (the int8
// activations of q4_gemm.cpp and q8_gemm.cpp moved it by a mean KL of 0.005-0.008
// nats and turned SmolLM2-135M's "The capital of France is Paris." into
// "L'Etoile, ...": bench/RESULTS.md runs 27-28). This is what vLLM's GGUF support
// does on a GPU (dequantize per tile, multiply in the activations' dtype).
//
// Per (tile of 8 columns, block of 32 inputs), with q the stored integers:
//   Q4_1: sum_k w_k x_k = d * sum_k q_k x_k + m * sum_k x_k   (w = d q + m)
//   Q8_0: sum_k w_k x_k = d * sum_k q_k x_k                   (w = d q)
// The inner sum runs over k in a fixed order as an outer product: for each k the 8
// columns' q (one register of int32 lanes cut from the packed bytes by a shift and
// a mask, converted to float) times the broadcast x_k, added into a per-block
// accumulator that is then scaled by the columns' d. Every row is computed alone
// in the same order whatever the row count, so a row's result does not depend on
// its batch. With AVX-512 two tiles share one 16-lane register (the same sums, the
// same order); a last odd tile and AVX2 use 8 lanes; CPUs without AVX2 run the same
// sums in scalar code.

#include "aten_headers.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "packed_tiles.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using packed_tiles::kBlock;
using packed_tiles::kCols;
constexpr int64_t kRowBlock = 64;  // activation rows per pass over the weights (kept in L2)

// The two formats' (tile, block) layouts: where the 8 columns' q of input k sit
// (register j of 32 bytes, byte lane 4c + i, and the bit offset of q in that int32
// lane) and the scales.
struct Q4 {
  static constexpr int64_t kTileBlockBytes = packed_tiles::kQ4TileBlockBytes;
  static constexpr int kRegisters = 4;  // of 8 values k each: k = 8j + i (low nibble), 8j + 4 + i (high)
  static constexpr bool kHasMin = true;
  // input k within the block for the s-th cut (s = 0..7) of register j; its bit offset is 4 s
  static constexpr int input(int j, int s) { return 8 * j + s / 2 + 4 * (s % 2); }
};
struct Q8 {
  static constexpr int64_t kTileBlockBytes = packed_tiles::kQ8TileBlockBytes;
  static constexpr int kRegisters = 8;  // of 4 values k each: k = 4j + i at bits 8i
  static constexpr bool kHasMin = false;
  static constexpr int input(int j, int s) { return 4 * j + s; }
};

// Integer q of lane c, cut s of register v (scalar reference of the vector code).
template <class F>
inline int32_t cut(uint32_t lane, int s) {
  if constexpr (F::kHasMin) return int32_t((lane >> (4 * s)) & 0x0F);
  else return int32_t(int8_t(uint8_t(lane >> (8 * s))));
}

using packed_tiles::from_half;

// Scales of column c of one (tile, block): Q4_1 fp16 d and m after the nibbles; Q8_0 float32 d in
// the separate scales tensor ([tiles, blocks, 8]).
template <class F>
inline void scalar_scales(const uint8_t* wb, const float* sb, int64_t c, float* d, float* m) {
  if constexpr (F::kHasMin) {
    uint16_t h[2];
    std::memcpy(&h[0], wb + packed_tiles::kQ4NibbleBytes + 2 * c, 2);
    std::memcpy(&h[1], wb + packed_tiles::kQ4NibbleBytes + 16 + 2 * c, 2);
    *d = from_half(h[0]);
    *m = from_half(h[1]);
  } else {
    *d = sb[c];
    *m = 0.0f;
  }
}

#if defined(__AVX2__)
// pshufb control taking byte B of each of a 128-bit lane's four int32 lanes to its bottom byte and
// zeroing the other three (index 0x80 writes zero).
template <int B>
inline __m128i kByteToBottom() {
  constexpr int kZero = int(0x80808000u);
  return _mm_setr_epi32(kZero | B, kZero | (4 + B), kZero | (8 + B), kZero | (12 + B));
}

// 8 lanes: one tile.
struct Lanes8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kTiles = 1;
  static I load(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F halves(const uint8_t* p, int64_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F floats(const float* p, int64_t) { return _mm256_loadu_ps(p); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  template <int S>
  static F nibble(I v) {  // bits 4S..4S+3 of each int32 lane
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * S), _mm256_set1_epi32(0x0F)));
  }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  // byte B of each int32 lane, zero-extended (one shuffle: the byte moved to the lane's bottom)
  template <int B>
  static F byte(I v) {
    const __m256i to_bottom = _mm256_broadcastsi128_si256(kByteToBottom<B>());
    return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, to_bottom));
  }
  template <int S>
  static F signed_byte(I v) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * S), 24));
  }
  // the first ncols (1..8) of acc at out
  static void store(F acc, float* out, int64_t ncols) {
    if (ncols == 8) return _mm256_storeu_ps(out, acc);
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc);
    std::memcpy(out, tmp, ncols * sizeof(float));
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 16 lanes: tile t in lanes 0..7, tile t + 1 (tile_bytes further on) in lanes 8..15.
struct Lanes16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kTiles = 2;
  static I load(const uint8_t* p, int64_t tile_bytes) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Lanes8::load(p, 0)), Lanes8::load(p + tile_bytes, 0), 1);
  }
  static F halves(const uint8_t* p, int64_t tile_bytes) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + tile_bytes));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }
  static F floats(const float* p, int64_t tile_floats) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + tile_floats), 1);
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  template <int S>
  static F nibble(I v) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * S), _mm512_set1_epi32(0x0F)));
  }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  template <int B>
  static F byte(I v) {
    const __m512i to_bottom = _mm512_broadcast_i32x4(kByteToBottom<B>());
    return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, to_bottom));
  }
  template <int S>
  static F signed_byte(I v) {
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * S), 24));
  }
  static void store(F acc, float* out, int64_t ncols) {  // ncols 9..16
    _mm256_storeu_ps(out, _mm512_castps512_ps256(acc));
    Lanes8::store(_mm512_extractf32x8_ps(acc, 1), out + 8, ncols - 8);
  }
};
#endif

#if defined(__AVX2__)
// Groups of tiles one row runs at once when the rows are few: independent FMA chains to cover
// the FMA latency (4 cycles on 2 ports) that R rows cover otherwise. 4 measured best with 8 and 16
// lanes alike (one row, 3072 x 576, on the Xeon of bench/RESULTS.md run 29 with the build capped
// at AVX2: 2 chains were 1.17x slower; 6 were no faster with either width).
constexpr int kChains = 4;
constexpr int64_t kFewRows = 4;  // fewer rows per pass than this run one at a time over kChains groups

template <class L>
constexpr int rows_per_call() {
  if constexpr (L::kTiles == 2) return 8;  // 2 x 8 accumulators of AVX-512's 32 registers
  else return 4;                          // 2 x 4 of AVX2's 16
}

// How a Q4_1 register is cut into 8 registers of q (exact small integers either way, so the
// choice changes no result): for few rows, nibbles masked once and a byte shuffle per cut (fewer
// operations); for many, a shift and a mask per cut (the shuffle port is the FMAs' second one).
template <int R>
constexpr bool kShuffle = R < 4;

// bacc[r * C + c] += group c's 8 (or 16) columns' q times row r's x_k, for the cuts S.. of
// register J: Q4_1's low nibbles (lo) and high nibbles (hi) masked once per register, a byte of
// either per cut; Q8_0's signed bytes of lo (= hi, the register as loaded).
template <class F, class L, int J, int S, int R, int C>
inline void cuts(const typename L::I* lo, const typename L::I* hi, const float* xb, int64_t x_stride,
                 typename L::F* bacc) {
  if constexpr (S < 32 / F::kRegisters) {
    constexpr int k = F::input(J, S);
    for (int c = 0; c < C; ++c) {
      typename L::F q;
      if constexpr (F::kHasMin && kShuffle<R>) q = L::template byte<S / 2>(S % 2 ? hi[c] : lo[c]);
      else if constexpr (F::kHasMin) q = L::template nibble<S>(lo[c]);
      else q = L::template signed_byte<S>(lo[c]);
      for (int r = 0; r < R; ++r) bacc[r * C + c] = L::fma(q, L::set1(xb[r * x_stride + k]), bacc[r * C + c]);
    }
    cuts<F, L, J, S + 1, R, C>(lo, hi, xb, x_stride, bacc);
  }
}

template <class F, class L, int J, int R, int C>
inline void registers(const uint8_t* wb, int64_t tile_bytes, const float* xb, int64_t x_stride, typename L::F* bacc) {
  if constexpr (J < F::kRegisters) {
    typename L::I lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const typename L::I v = L::load(wb + c * L::kTiles * tile_bytes + 32 * J, tile_bytes);
      lo[c] = F::kHasMin && kShuffle<R> ? L::low_nibbles(v) : v;
      hi[c] = F::kHasMin && kShuffle<R> ? L::high_nibbles(v) : v;
    }
    cuts<F, L, J, 0, R, C>(lo, hi, xb, x_stride, bacc);
    registers<F, L, J + 1, R, C>(wb, tile_bytes, xb, x_stride, bacc);
  }
}

// out[r][0..ncols) for R rows of x (x_stride apart, K = k_blocks * 32) against C groups of
// L::kTiles adjacent tiles (one tile, or two with Lanes16) of packed weights wq (and Q8_0 scales
// sq); with C > 1 every group is full. Each output lane gets the same operations in the same
// order whatever R and C: C > 1 only gives one row several independent FMA chains.
template <class F, class L, int R, int C = 1>
void tile_rows(const float* x, int64_t x_stride, const float* xsum, int64_t k_blocks, const uint8_t* wq,
               const float* sq, float* out, int64_t out_stride, int64_t ncols) {
  const int64_t tile_bytes = k_blocks * F::kTileBlockBytes, tile_floats = k_blocks * kCols;
  typename L::F acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = L::zero();
  for (int64_t b = 0; b < k_blocks; ++b) {
    const uint8_t* wb = wq + b * F::kTileBlockBytes;
    const float* xb = x + b * kBlock;
    typename L::F bacc[R * C];
    for (int i = 0; i < R * C; ++i) bacc[i] = L::zero();
    registers<F, L, 0, R, C>(wb, tile_bytes, xb, x_stride, bacc);
    for (int c = 0; c < C; ++c) {
      const uint8_t* gb = wb + c * L::kTiles * tile_bytes;
      if constexpr (F::kHasMin) {
        const typename L::F d = L::halves(gb + packed_tiles::kQ4NibbleBytes, tile_bytes);
        const typename L::F m = L::halves(gb + packed_tiles::kQ4NibbleBytes + 16, tile_bytes);
        for (int r = 0; r < R; ++r) {
          acc[r * C + c] = L::fma(bacc[r * C + c], d, acc[r * C + c]);
          acc[r * C + c] = L::fma(m, L::set1(xsum[r * k_blocks + b]), acc[r * C + c]);
        }
      } else {
        const typename L::F d = L::floats(sq + c * L::kTiles * tile_floats + b * kCols, tile_floats);
        for (int r = 0; r < R; ++r) acc[r * C + c] = L::fma(bacc[r * C + c], d, acc[r * C + c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      L::store(acc[r * C + c], out + r * out_stride + c * L::kTiles * kCols, C > 1 ? L::kTiles * kCols : ncols);
}
#endif

// The scalar build: the same sums in the same order, one column at a time.
template <class F>
void tile_rows_scalar(const float* x, int64_t x_stride, const float* xsum, int64_t rows, int64_t k_blocks,
                      const uint8_t* wq, const float* sq, float* out, int64_t out_stride, int64_t ncols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < ncols; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < k_blocks; ++b) {
        const uint8_t* wb = wq + b * F::kTileBlockBytes;
        const float* xb = x + r * x_stride + b * kBlock;
        float bacc = 0.0f, d, m;
        for (int j = 0; j < F::kRegisters; ++j) {
          uint32_t lane;
          std::memcpy(&lane, wb + 32 * j + 4 * c, 4);
          for (int s = 0; s < 32 / F::kRegisters; ++s) bacc += float(cut<F>(lane, s)) * xb[F::input(j, s)];
        }
        scalar_scales<F>(wb, sq + b * kCols, c, &d, &m);
        acc += bacc * d;
        if constexpr (F::kHasMin) acc += m * xsum[r * k_blocks + b];
      }
      out[r * out_stride + c] = acc;
    }
  }
}

#if defined(__AVX2__)
// rows [r, r + left) of one tile group, left < rows_per_call, R counting down.
template <class F, class L, int R = rows_per_call<L>() - 1>
void tail_rows(int64_t left, const float* x, int64_t x_stride, const float* xsum, int64_t k_blocks,
               const uint8_t* wq, const float* sq, float* out, int64_t out_stride, int64_t ncols) {
  if constexpr (R > 0) {
    if (left == R) tile_rows<F, L, R>(x, x_stride, xsum, k_blocks, wq, sq, out, out_stride, ncols);
    else tail_rows<F, L, R - 1>(left, x, x_stride, xsum, k_blocks, wq, sq, out, out_stride, ncols);
  }
}

// Rows [m0, m1) of one group of L::kTiles tiles starting at tile t.
template <class F, class L>
void group_rows(int64_t m0, int64_t m1, const float* x, int64_t x_stride, const float* xsum, int64_t k_blocks,
                const uint8_t* wq, const float* sq, float* out, int64_t out_stride, int64_t ncols) {
  constexpr int R = rows_per_call<L>();
  int64_t r = m0;
  for (; r + R <= m1; r += R)
    tile_rows<F, L, R>(x + r * x_stride, x_stride, xsum + r * k_blocks, k_blocks, wq, sq, out + r * out_stride,
                       out_stride, ncols);
  tail_rows<F, L>(m1 - r, x + r * x_stride, x_stride, xsum + r * k_blocks, k_blocks, wq, sq, out + r * out_stride,
                  out_stride, ncols);
}
#endif

// out [M, N] (rows out_stride apart) = x [M, K] (rows x_stride apart) @ W.T, W packed as F.
template <class F>
void dequant_linear(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t m, int64_t n,
                    int64_t k_blocks, const uint8_t* wq, const float* sq) {
  const int64_t tiles = (n + kCols - 1) / kCols, tile_bytes = k_blocks * F::kTileBlockBytes;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  using Wide = Lanes16;
#elif defined(__AVX2__)
  using Wide = Lanes8;
#endif
  constexpr int64_t kGroup =
#if defined(__AVX2__)
      Wide::kTiles;
#else
      1;
#endif
  const int64_t groups = (tiles + kGroup - 1) / kGroup;
  // Q4_1: each row's sum of each block's inputs (in input order), for the m term
  std::vector<float> sums(F::kHasMin ? m * k_blocks : 0);
  float* xsum = sums.data();
  if constexpr (F::kHasMin) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < k_blocks; ++b) {
        float s = 0.0f;
        for (int64_t k = 0; k < kBlock; ++k) s += x[r * x_stride + b * kBlock + k];
        xsum[r * k_blocks + b] = s;
      }
  }
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    at::parallel_for(0, groups, 2, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) {
        const int64_t t = g * kGroup, ncols = std::min(kGroup * kCols, n - t * kCols);
        const uint8_t* tw = wq + t * tile_bytes;
        const float* ts = sq ? sq + t * k_blocks * kCols : nullptr;
        float* to = out + t * kCols;
#if defined(__AVX2__)
        constexpr int C = kChains;
        if (m1 - m0 < kFewRows && g + C <= last && (t + C * kGroup) * kCols <= n) {
          for (int64_t r = m0; r < m1; ++r)
            tile_rows<F, Wide, 1, C>(x + r * x_stride, x_stride, xsum + r * k_blocks, k_blocks, tw, ts,
                                     to + r * out_stride, out_stride, C * kGroup * kCols);
          g += C - 1;
        } else if (ncols > (kGroup - 1) * kCols)
          group_rows<F, Wide>(m0, m1, x, x_stride, xsum, k_blocks, tw, ts, to, out_stride, ncols);
        else  // a last tile without a partner
          group_rows<F, Lanes8>(m0, m1, x, x_stride, xsum, k_blocks, tw, ts, to, out_stride, ncols);
#else
        tile_rows_scalar<F>(x + m0 * x_stride, x_stride, xsum + m0 * k_blocks, m1 - m0, k_blocks, tw, ts,
                            to + m0 * out_stride, out_stride, ncols);
#endif
      }
    });
  }
}

void check_activations(const char* name, const at::Tensor& out, const at::Tensor& x, int64_t blocks, int64_t tiles) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name,
              ": x must be a CPU float32 [M, K] with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              name, ": out must be a CPU float32 [M, N] with contiguous rows");
  TORCH_CHECK(x.size(1) == blocks * kBlock && (out.size(1) + kCols - 1) / kCols == tiles, name,
              ": shapes disagree: x ", x.sizes(), ", out ", out.sizes(), ", ", tiles, " tiles of ", blocks, " blocks");
}

}  // namespace

// out float32 [M, N] = x @ W.T for x float32 [M, K] (contiguous rows) and W the Q4_1 weight
// packed by q4_1_pack_weight (uint8 [ceil(N/8), K/32, 160]), dequantized in registers. With
// bf16_activations, x is rounded to bfloat16 and dequant_gemm_bf16.cpp's vdpbf16ps path runs
// (an error where it is not compiled: dequant_bf16_compiled()).
void q4_1_dequant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, bool bf16_activations) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == Q4::kTileBlockBytes && packed.is_contiguous(),
              "q4_1_dequant_linear: packed weight must be a contiguous CPU uint8 [tiles, blocks, 160]");
  check_activations("q4_1_dequant_linear", out, x, packed.size(1), packed.size(0));
  if (bf16_activations)
    return q4_1_dequant_linear_bf16_raw(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0),
                                        x.size(0), out.size(1), packed.size(1), packed.data_ptr<uint8_t>());
  dequant_linear<Q4>(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0), x.size(0), out.size(1),
                     packed.size(1), packed.data_ptr<uint8_t>(), nullptr);
}

// out float32 [M, N] = x @ W.T for x float32 [M, K] (contiguous rows) and W the Q8_0 weight
// packed by q8_pack_weight (int8 [ceil(N/8), K/32, 288] and float32 scales [ceil(N/8), K/32, 8]);
// bf16_activations as for q4_1_dequant_linear.
void q8_0_dequant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor scales, bool bf16_activations) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kChar && packed.dim() == 3 &&
                  packed.size(2) == Q8::kTileBlockBytes && packed.is_contiguous(),
              "q8_0_dequant_linear: packed weight must be a contiguous CPU int8 [tiles, blocks, 288]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == packed.size(0) &&
                  scales.size(1) == packed.size(1) && scales.size(2) == kCols && scales.is_contiguous(),
              "q8_0_dequant_linear: scales must be float32 [tiles, blocks, 8], contiguous");
  check_activations("q8_0_dequant_linear", out, x, packed.size(1), packed.size(0));
  if (bf16_activations)
    return q8_0_dequant_linear_bf16_raw(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0),
                                        x.size(0), out.size(1), packed.size(1),
                                        reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()),
                                        scales.data_ptr<float>());
  dequant_linear<Q8>(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0), x.size(0), out.size(1),
                     packed.size(1), reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()),
                     scales.data_ptr<float>());
}
