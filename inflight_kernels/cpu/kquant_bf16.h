// The K-quant product for steps of many rows on CPUs with AVX-512 BF16 (prefill chunks,
// batched decode): each thread dequantizes a group of up to kGroupTiles tiles of 16 rows of W
// (a run of at most kChunkBlocks super-blocks of K at a time) into bf16_micro.h's bfloat16 tile
// layout in its own buffer (256 KB, kept in L2), and multiplies every activation row, rounded to
// bfloat16 once per call, with it through vdpbf16ps. Nothing is kept between calls: memory
// still follows the file. Included by kquant_gemm.cpp inside its anonymous namespace, after
// kquant_avx512.h, whose sources give each super-block's scaled integers v, its scale d and its
// groups' offsets o (w_i = d v_i - o_g), here turned to float32 and rounded to bfloat16.
//
// Why: at many rows a step is bound by arithmetic. The int16 products (kquant_avx512.h) read
// one activation vector per vpdpwssd and scale every super-block's sums per row, where the
// bfloat16 micro-kernel reuses each loaded weight vector for 4 rows and each broadcast
// activation pair for 4 tiles; single-thread on a Zen 4 EPYC the int16 products ran 2048 x
// 16384 Q4_K at 33-39 G multiply-adds/s from 16 to 64 rows, a dense bfloat16 copy of the
// same weight 84-105 (bench/RESULTS.md run 42 has the whole-step figures). Dequantizing in
// each call costs about one instruction per weight and per pair of 16 (vectorized, below).
//
// Numerics: the weights and the activations are rounded to bfloat16 (8 significant bits), the
// sums are float32 in k order, as a dense bfloat16 copy gives (teacher-forced accuracy:
// bench/RESULTS.md runs 35 and 42). The values differ from the int16 products', so a row's
// result depends on whether its step had `dense_min_rows` rows or more (--deterministic turns
// this path off, as it does the dense copies).

#if KQUANT_AVX512 && defined(INFLIGHT_BF16_MICRO)
#define KQUANT_BF16 1

constexpr int64_t kGroupTiles = 4;     // tiles of 16 rows of W dequantized together (64 output columns)
constexpr int64_t kChunkBlocks = 8;    // super-blocks of K per pass: 64 x 2048 bf16 = 256 KB of tiles
constexpr int64_t kBf16Rows = 4;       // activation rows per micro-kernel call

// The 16 x 16 transpose of 32-bit lanes: in[c] lane i -> out[i] lane c (unpack, then two
// 128-bit lane shuffles; 64 instructions for 16 vectors).
KQ_INLINE void transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // v[4q + s], 128-bit lane L: rows 4q .. 4q + 3 of column 4L + s; two shuffles gather each column's lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// 32 scaled integers (one chunk of a super-block) as bfloat16 d v - o, offsets o_lo for the
// first 16 values and o_hi for the last 16: 16 pairs, one per 32-bit lane, in k order.
KQ_INLINE __m512i dequantize_chunk(__m512i v, __m512 d, __m512 o_lo, __m512 o_hi) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(hi, d, o_hi), _mm512_fmsub_ps(lo, d, o_lo));
}

// Super-block b of one row of W as 8 vectors of bfloat16 pairs (chunk j: values 32j .. 32j + 31).
template <class Source>
KQ_INLINE void dequantize_block(const Source& src, int64_t b, __m512i* out) {
  __m512i v[8];
  float d;
  __m512 o;
  src.load(b, v, d, o);
  alignas(64) float offsets[16];
  _mm512_store_ps(offsets, o);
  const __m512 dv = _mm512_set1_ps(d);
  for (int j = 0; j < 8; ++j) {
    const int lo = Source::kGroup == 32 ? j : 2 * j, hi = Source::kGroup == 32 ? j : 2 * j + 1;
    out[j] = dequantize_chunk(v[j], dv, _mm512_set1_ps(offsets[lo]), _mm512_set1_ps(offsets[hi]));
  }
}

// Q4_K / Q5_K super-block b through tables: a chunk of 32 values shares one scale s and offset o
// (its group), so its 16 (Q4_K) or 32 (Q5_K) possible values s u - o are computed once, rounded
// to bfloat16, and vpermw picks each value's entry by its u. The same values as
// dequantize_chunk (d sc is exact in float32, u (d sc) - o one fused rounding either way) for
// about half the instructions: Q4_K and Q5_K hold most of a Q4_K_M/Q5_K_M file's weights.
template <int Levels, class File>
KQ_INLINE void dequantize_k4_block(const File& file, int64_t b, __m512i* out) {
  const uint8_t* block = file.w + b * file.bytes;
  alignas(16) uint8_t sc[8], mn[8];
  k4_int_scales(block, sc, mn);
  alignas(32) float scale[8], offset[8];
  const auto bytes8 = [](const uint8_t* v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
  };
  _mm256_store_ps(scale, _mm256_mul_ps(bytes8(sc), _mm256_set1_ps(half_at(block))));
  _mm256_store_ps(offset, _mm256_mul_ps(bytes8(mn), _mm256_set1_ps(half_at(block + 2))));
  const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 high = _mm512_add_ps(low, _mm512_set1_ps(16.0f));
  for (int c = 0; c < 8; ++c) {
    const __m512 s = _mm512_set1_ps(scale[c]), o = _mm512_set1_ps(offset[c]);
    const __m512i table =
        Levels == 16 ? _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmsub_ps(low, s, o)))
                     : (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(high, s, o), _mm512_fmsub_ps(low, s, o));
    out[c] = _mm512_permutexvar_epi16(widen(file.chunk(b, c)), table);
  }
}

// One row of W's super-block b (file bytes `w`, ggml type `type`) as bfloat16 pairs.
void dequantize_row_block(int64_t type, const uint8_t* w, int64_t b, __m512i* out) {
  const int64_t bytes = block_bytes(type);
  switch (type) {
    case kQ4K: return dequantize_k4_block<16>(Q4KFile{w, bytes}, b, out);
    case kQ5K: return dequantize_k4_block<32>(Q5KFile{w, bytes}, b, out);
    case kQ6K: return dequantize_block(Q6KScaled{{w, bytes}}, b, out);
    default: break;
  }
  Scaled s;
  if (type == kQ3K) {
    scale_q3_k(w + b * bytes, s);
    dequantize_block(ScaledRow<false, 16>{&s}, 0, out);
  } else {
    scale_q2_k(w + b * bytes, s);
    dequantize_block(ScaledRow<true, 16>{&s}, 0, out);
  }
}

// Tile `tile` (16 rows of W: rows[c] the bytes of row c, types[c] its type, nullptr past N)
// over super-blocks b0 .. b1 - 1 into `dst`: pair p of the run at dst + 32 p (bf16_micro.h's layout).
void dequantize_tile(const uint8_t* const* rows, const int64_t* types, int64_t b0, int64_t b1, uint16_t* dst) {
  for (int64_t b = b0; b < b1; ++b) {
    __m512i chunk[8][16];
    for (int c = 0; c < 16; ++c) {
      __m512i v[8];
      if (rows[c] != nullptr) dequantize_row_block(types[c], rows[c], b, v);
      else for (int j = 0; j < 8; ++j) v[j] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) chunk[j][c] = v[j];
    }
    for (int j = 0; j < 8; ++j) {
      transpose16(chunk[j]);  // chunk[j][i] lane c = pair 16 j + i of row c
      uint16_t* at = dst + ((b - b0) * 128 + 16 * j) * 32;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(at + 32 * i, chunk[j][i]);
    }
  }
}

// x float32 [m, k] (rows x_stride apart) -> bfloat16 [m, k] (round to nearest even).
void round_to_bf16(const float* x, int64_t x_stride, int64_t m, int64_t k, uint16_t* out) {
  at::parallel_for(0, m, 8, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t i = 0; i < k; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * k + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * x_stride + i)));
  });
}

// out[m, n] (float32, rows os apart) = x @ W.T with W's rows given by `row_of(col)` (bytes,
// type) for col < n: the many-rows product through bfloat16 tiles.
template <class RowOf>
void kquant_bf16_product(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t n, const RowOf& row_of,
                         float* out, int64_t os) {
  // c10's allocator aligns to 64 bytes: a std::vector's 16 left every tile load split across two
  // cache lines, which ran the micro-kernel 8x slower (Zen 4, single thread, 2048 rows).
  const at::Tensor xb_owner = at::empty({m * k}, at::kShort);
  uint16_t* xb = reinterpret_cast<uint16_t*>(xb_owner.data_ptr<int16_t>());
  round_to_bf16(x, x_stride, m, k, xb);
  const int64_t sblocks = k / kSuper, tiles = (n + bf16_micro::kCols - 1) / bf16_micro::kCols;
  const int64_t groups = (tiles + kGroupTiles - 1) / kGroupTiles;
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    const at::Tensor buffer_owner = at::empty({kGroupTiles * kChunkBlocks * kSuper * bf16_micro::kCols}, at::kShort);
    uint16_t* buffer = reinterpret_cast<uint16_t*>(buffer_owner.data_ptr<int16_t>());
    const int64_t tile_stride = kChunkBlocks * kSuper * bf16_micro::kCols;  // uint16 per tile in the buffer
    for (int64_t g = first; g < last; ++g) {
      const int64_t t0 = g * kGroupTiles, nt = std::min(kGroupTiles, tiles - t0), c0 = t0 * bf16_micro::kCols;
      const uint8_t* rows[kGroupTiles][16];
      int64_t types[kGroupTiles][16];
      for (int64_t t = 0; t < nt; ++t)
        for (int c = 0; c < 16; ++c) {
          const int64_t col = c0 + t * 16 + c;
          rows[t][c] = nullptr;
          types[t][c] = kQ4K;
          if (col < n) row_of(col, rows[t][c], types[t][c]);
        }
      for (int64_t b0 = 0; b0 < sblocks; b0 += kChunkBlocks) {
        const int64_t b1 = std::min(sblocks, b0 + kChunkBlocks), pairs = (b1 - b0) * kSuper / 2;
        for (int64_t t = 0; t < nt; ++t) dequantize_tile(rows[t], types[t], b0, b1, buffer + t * tile_stride);
        const uint16_t* xk = xb + b0 * kSuper;
        for (int64_t r = 0; r < m; r += kBf16Rows) {
          const int nr = static_cast<int>(std::min(kBf16Rows, m - r));
          bf16_micro::micro_any(nr, static_cast<int>(nt), xk + r * k, k, buffer, tile_stride, pairs, nullptr,
                                bf16_micro::Out{out + r * os + c0, true, os, b0 > 0}, n - c0);
        }
      }
    }
  });
}

#else
#define KQUANT_BF16 0
#endif
