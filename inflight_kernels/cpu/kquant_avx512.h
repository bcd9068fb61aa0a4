// The K-quant products on AVX-512 (F + BW; VNNI's vpdpwssd when the CPU has it), included
// by kquant_gemm.cpp inside its anonymous namespace, after the AVX2 sources it reuses.
//
// The AVX2 code keeps a float scale per group of 16 or 32 values, so each group's int32
// sum must be folded out of its vector (vphaddd) before it meets its scale. Here the
// group's integer scale is multiplied into the weights instead, in int16, once per
// super-block: v_i = u_i * sc_g with u signed where the format's offset is a fixed multiple
// of its scale (Q6_K: q - 32; Q3_K: q - 4), so that
//   sum_i w_i x_i = d dx sum_i v_i xq_i - sum_g o_g (dx sum_{i in g} xq_i),
// and the 256 products of a super-block accumulate in one vector of 16 int32 lanes, 8
// vpdpwssd, with no fold. The int16 products fit (|v| <= 4096: Q6_K's |q - 32| <= 32 times
// |sc| <= 128), and so do their sums: each lane adds 16 products of at most
// 4096 * 32767, 2,147,352,576 < 2^31. The lanes meet d dx in one float32 FMA per super-block
// and row, the offsets in one more, in a fixed order whatever the row count, so a row's
// result does not depend on its batch (and the few-rows path, which scales the weights in
// registers straight from the file's bytes, gives the same values as the many-rows path,
// which stores them once per row of W).
//
// Measured (single thread, AMD EPYC Zen 5, 2026-12-05, a harness timing thread CPU time against
// the AVX2 products of the same source): 32 rows of K = 2048 x N = 8192 Q4_K 7.1 against 9.2 ms,
// K = 8192 x N = 2048 Q6_K 7.3 against 10.4 ms; one row 0.46 against 0.44 ms and 0.47 against 0.55 ms.
//
// Values stay in natural order (stored_at is the identity in this build): one vpmovzxbw
// widens 32 weight bytes to the 32 int16 lanes that meet one 64-byte load of activations.

#define KQ_INLINE inline __attribute__((always_inline))  // keeps a block's 8 vectors in registers

constexpr int64_t kRows512 = 8;  // activation rows per micro-kernel call of the many-rows path

// One super-block with its integer scales multiplied in.
struct Scaled {
  alignas(64) int16_t v[kSuper];  // natural order
  alignas(64) float offset[16];   // o_g, natural group order; zero past the format's groups
  float d;                        // the super-block's float scale
};

KQ_INLINE __m512i widen(__m256i u) { return _mm512_cvtepu8_epi16(u); }

// Q4_K / Q5_K's 6-bit scales and minimums (k4_packed) as bytes.
KQ_INLINE void k4_int_scales(const uint8_t* block, uint8_t* sc, uint8_t* mn) {
  const K4Packed packed = k4_packed(block);
  std::memcpy(sc, &packed.scales, 8);
  std::memcpy(mn, &packed.mins, 8);
}

// Sources for dot512: `load(b, v, d, o)` gives super-block b's 8 scaled vectors, its float
// scale and its 16 offsets (zero-padded). kOffsets: whether the format has offsets at all.

// Q5_K straight from the file (layout at unpack_q5_k).
template <class File>
struct K4Scaled {
  static constexpr bool kOffsets = true;
  static constexpr int kGroup = 32;
  File file;
  KQ_INLINE void load(int64_t b, __m512i* v, float& d, __m512& o) const {
    const uint8_t* block = file.w + b * file.bytes;
    alignas(16) uint8_t sc[8], mn[8];
    k4_int_scales(block, sc, mn);
    for (int c = 0; c < 8; ++c) v[c] = _mm512_mullo_epi16(widen(file.chunk(b, c)), _mm512_set1_epi16(sc[c]));
    d = half_at(block);
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
    o = _mm512_zextps256_ps512(_mm256_mul_ps(m, _mm256_set1_ps(half_at(block + 2))));
  }
};

// Q4_K straight from the file: one vpmovzxbw widens the 32 bytes of two chunks, whose low
// nibbles are chunk 2j and high nibbles chunk 2j + 1 (layout at unpack_q4_k).
struct Q4KScaled {
  static constexpr bool kOffsets = true;
  static constexpr int kGroup = 32;
  Q4KFile file;
  KQ_INLINE void load(int64_t b, __m512i* v, float& d, __m512& o) const {
    const uint8_t* block = file.w + b * file.bytes;
    alignas(16) uint8_t sc[8], mn[8];
    k4_int_scales(block, sc, mn);
    const __m512i low = _mm512_set1_epi16(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i q = widen(load32(block + 16 + 32 * j));
      v[2 * j] = _mm512_mullo_epi16(_mm512_and_si512(q, low), _mm512_set1_epi16(sc[2 * j]));
      v[2 * j + 1] = _mm512_mullo_epi16(_mm512_srli_epi16(q, 4), _mm512_set1_epi16(sc[2 * j + 1]));
    }
    d = half_at(block);
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
    o = _mm512_zextps256_ps512(_mm256_mul_ps(m, _mm256_set1_ps(half_at(block + 2))));
  }
};

// Q6_K straight from the file: v = (q - 32) sc, no offsets. Each half of the block (128 values)
// is rebuilt from one 64-byte load of low nibbles and one 32-byte load of high bit pairs in byte
// lanes (layout at unpack_q6_k), biased to int8 there, then widened 32 values at a time; a
// chunk's two group scales come from one vpermw of the 16 scales. The same integers as the
// AVX2 chunk() source for about half the instructions (the one-row product of a 2048 x 8192
// Q6_K weight ran 2.2x slower than the AVX2 build's before, on Zen 4).
struct Q6KScaled {
  static constexpr bool kOffsets = false;
  static constexpr int kGroup = 16;
  Q6KFile file;
  KQ_INLINE void load(int64_t b, __m512i* v, float& d, __m512& o) const {
    const uint8_t* block = file.w + b * file.bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03), bias = _mm512_set1_epi8(32);
    const __m512i scales =
        _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192))));
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // lanes 16-31: group + 1
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512(block + 64 * h);
      const __m256i hb = load32(block + 128 + 32 * h);
      // bytes 0-31: the pairs of quarters 0 and 2 (bits 0-1, 4-5); bytes 32-63: of quarters 1 and 3 (bits 2-3, 6-7)
      const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
      // 16-bit shifts move bits across byte edges; each mask keeps only bits that stayed in their byte
      const __m512i quarters01 = _mm512_sub_epi8(
          _mm512_or_si512(_mm512_and_si512(q, low4), _mm512_slli_epi16(_mm512_and_si512(hh, two), 4)), bias);
      const __m512i quarters23 = _mm512_sub_epi8(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), low4),
                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), two), 4)),
          bias);
      for (int quarter = 0; quarter < 4; ++quarter) {
        const __m512i both = quarter < 2 ? quarters01 : quarters23;
        const __m256i bytes = quarter & 1 ? _mm512_extracti64x4_epi64(both, 1) : _mm512_castsi512_si256(both);
        const int c = 4 * h + quarter;
        const __m512i sc = _mm512_permutexvar_epi16(_mm512_add_epi16(second, _mm512_set1_epi16(int16_t(2 * c))), scales);
        v[c] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(bytes), sc);
      }
    }
    d = half_at(block + 208);
    o = _mm512_setzero_ps();
  }
};

// Q3_K in scalar code (rare in real files): v = (q + 4 hbit - 4) (sc - 32), no offsets.
void scale_q3_k(const uint8_t* block, Scaled& out) {
  Unpacked u;
  unpack_q3_k(block, u);
  const uint8_t* packed = block + 96;
  int sc[16];
  for (int g = 0; g < 16; ++g) {
    const int lo = g < 8 ? packed[g] & 0xF : packed[g - 8] >> 4;
    sc[g] = (lo | (((packed[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
  }
  for (int i = 0; i < kSuper; ++i) out.v[stored_at(i)] = int16_t((int(u.u[i]) - 4) * sc[i / 16]);
  std::fill(out.offset, out.offset + 16, 0.0f);
  out.d = half_at(block + 108);
}

// Q2_K in scalar code: v = q sc (4-bit), offsets dmin m.
void scale_q2_k(const uint8_t* block, Scaled& out) {
  Unpacked u;
  unpack_q2_k(block, u);
  const float dmin = half_at(block + 82);
  for (int i = 0; i < kSuper; ++i) out.v[stored_at(i)] = int16_t(int(u.u[i]) * (block[i / 16] & 0xF));
  for (int g = 0; g < 16; ++g) out.offset[g] = dmin * float(block[g] >> 4);
  out.d = half_at(block + 80);
}

// A row of W already scaled (the many-rows path; Q2_K and Q3_K on every path).
template <bool Offsets, int Group>
struct ScaledRow {
  static constexpr bool kOffsets = Offsets;
  static constexpr int kGroup = Group;
  const Scaled* row;
  KQ_INLINE void load(int64_t b, __m512i* v, float& d, __m512& o) const {
    for (int c = 0; c < 8; ++c) v[c] = _mm512_load_si512(row[b].v + 32 * c);
    d = row[b].d;
    o = _mm512_load_ps(row[b].offset);
  }
};

// Writes super-block b of a source into a Scaled.
template <class Source>
void store_scaled(const Source& src, int64_t b, Scaled& out) {
  __m512i v[8];
  __m512 o;
  src.load(b, v, out.d, o);
  for (int c = 0; c < 8; ++c) _mm512_store_si512(out.v + 32 * c, v[c]);
  _mm512_store_ps(out.offset, o);
}

// Super-block b of a row of W (`bytes` each), fetched kPrefetchBytes ahead of the products.
KQ_INLINE void prefetch_ahead(const uint8_t* row, int64_t b, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(row + b * bytes) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

KQ_INLINE __m512i dot_pairs(__m512i acc, __m512i v, const int16_t* x) {
  const __m512i xv = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, v, xv);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(v, xv));
#endif
}

// acc[0 .. R) += row of W (super-blocks b0 .. b1 - 1 of `src`) . activation rows r0 .. r0 + R - 1,
// per super-block one int32 vector of its 256 products, then d dx times it and minus the
// offsets' share in float32. `prefetch`: the row's bytes in the file, fetched kPrefetchBytes ahead.
template <int R, class Source>
void dot512(const Source& src, int64_t b0, int64_t b1, const Activations& a, int64_t r0, __m512* acc_io,
            const uint8_t* prefetch = nullptr, int64_t prefetch_bytes = 0) {
  const int64_t k = a.k, nsb = k / kSuper, gk = k / Source::kGroup;
  const float* sums = a.sum(Source::kGroup);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_io[r];
  for (int64_t b = b0; b < b1; ++b) {
    if (prefetch != nullptr) prefetch_ahead(prefetch, b, prefetch_bytes);
    __m512i v[8];
    float d;
    __m512 o;
    src.load(b, v, d, o);
    // The rows' chains of 8 dependent vpdpwssd interleaved, one chunk of 32 values for every row in turn.
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    const int16_t* x0 = a.q.data() + r0 * k + b * kSuper;
    for (int c = 0; c < 8; ++c)
      for (int r = 0; r < R; ++r) s[r] = dot_pairs(s[r], v[c], x0 + r * k + 32 * c);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(d * a.scale[(r0 + r) * nsb + b]), acc[r]);
      if (Source::kOffsets) {
        const float* xs = sums + (r0 + r) * gk + b * (kSuper / Source::kGroup);
        const __m512 xv = Source::kGroup == 32 ? _mm512_zextps256_ps512(_mm256_loadu_ps(xs)) : _mm512_loadu_ps(xs);
        acc[r] = _mm512_fnmadd_ps(o, xv, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) acc_io[r] = acc[r];
}

template <class Source>
void dot512_count(const Source& src, int64_t b0, int64_t b1, const Activations& a, int64_t r0, int64_t count,
                  __m512* acc, const uint8_t* prefetch = nullptr, int64_t prefetch_bytes = 0) {
  switch (count) {
    case 8: return dot512<8>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    case 7: return dot512<7>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    case 6: return dot512<6>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    case 5: return dot512<5>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    case 4: return dot512<4>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    case 3: return dot512<3>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    case 2: return dot512<2>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
    default: return dot512<1>(src, b0, b1, a, r0, acc, prefetch, prefetch_bytes);
  }
}

// One row of W (`w`, ggml type `type`, `bytes` per super-block) into Scaled blocks.
void scale_row(int64_t type, const uint8_t* w, int64_t bytes, int64_t blocks, Scaled* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    switch (type) {
      case kQ4K: store_scaled(Q4KScaled{{w, bytes}}, b, out[b]); break;
      case kQ5K: store_scaled(K4Scaled<Q5KFile>{{w, bytes}}, b, out[b]); break;
      case kQ6K: store_scaled(Q6KScaled{{w, bytes}}, b, out[b]); break;
      case kQ3K: scale_q3_k(w + b * bytes, out[b]); break;
      default: scale_q2_k(w + b * bytes, out[b]); break;
    }
  }
}

// acc[0 .. count) += activation rows r0 .. r0 + count - 1 (count <= kRows512) against super-blocks
// b0 .. b1 - 1 of one scaled row of W.
void dot_scaled_rows(int64_t type, const Scaled* row, int64_t b0, int64_t b1, const Activations& a, int64_t r0,
                     int64_t count, __m512* acc) {
  switch (type) {
    case kQ4K:
    case kQ5K: return dot512_count(ScaledRow<true, 32>{row}, b0, b1, a, r0, count, acc);
    case kQ2K: return dot512_count(ScaledRow<true, 16>{row}, b0, b1, a, r0, count, acc);
    default: return dot512_count(ScaledRow<false, 16>{row}, b0, b1, a, r0, count, acc);  // Q3_K, Q6_K
  }
}

// A few (at most kRows) activation rows against one row of W, scaled in registers from the
// file's bytes (Q2_K, Q3_K: through `buffer`).
void dot_few_rows512(int64_t type, const uint8_t* w, int64_t bytes, int64_t blocks, const Activations& a, int64_t m,
                     float* out, int64_t os, Scaled* buffer) {
  __m512 acc[kRows];
  for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
  switch (type) {
    case kQ4K: dot512_count(Q4KScaled{{w, bytes}}, 0, blocks, a, 0, m, acc, w, bytes); break;
    case kQ5K: dot512_count(K4Scaled<Q5KFile>{{w, bytes}}, 0, blocks, a, 0, m, acc, w, bytes); break;
    case kQ6K: dot512_count(Q6KScaled{{w, bytes}}, 0, blocks, a, 0, m, acc, w, bytes); break;
    default:
      scale_row(type, w, bytes, blocks, buffer);
      dot_scaled_rows(type, buffer, 0, blocks, a, 0, m, acc);
  }
  for (int64_t r = 0; r < m; ++r) out[r * os] = _mm512_reduce_add_ps(acc[r]);
}

// Many rows (kColumnBlock rows of W scaled in `rows`, columns c0 .. c1 - 1 of out): kRows512
// activation rows at a time meet each row of W over kKChunk super-blocks, then the next
// chunk, so the activations of a chunk (16 KB) stay in L1 while all the columns pass;
// the accumulators carry over, so each row's sums are in the same order as on the few-rows path.
constexpr int64_t kKChunk = 4;

void dot_many_rows512(const int64_t* type, const Scaled* rows, int64_t sblocks, int64_t c0, int64_t c1,
                      const Activations& a, int64_t m, float* out, int64_t os) {
  __m512 acc[kColumnBlock][kRows512];
  for (int64_t r = 0; r < m; r += kRows512) {
    const int64_t count = std::min(kRows512, m - r);
    for (int64_t col = 0; col < c1 - c0; ++col)
      for (int64_t i = 0; i < count; ++i) acc[col][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < sblocks; b += kKChunk)
      for (int64_t col = 0; col < c1 - c0; ++col)
        dot_scaled_rows(type[col], rows + col * sblocks, b, std::min(sblocks, b + kKChunk), a, r, count, acc[col]);
    for (int64_t col = 0; col < c1 - c0; ++col)
      for (int64_t i = 0; i < count; ++i) out[(r + i) * os + c0 + col] = _mm512_reduce_add_ps(acc[col][i]);
  }
}
