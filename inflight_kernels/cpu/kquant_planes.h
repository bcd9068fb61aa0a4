// One or two activation rows against Q4_K, Q5_K and Q6_K weights on AVX-512 (BW; VNNI's vpdpwssd where
// the CPU has it), included by kquant_gemm.cpp after kquant_avx512.h, inside its anonymous
// namespace. The same integers as kquant_avx512.h's dot512, lane for lane, for fewer instructions
// when the weights are unpacked for only one or two rows: one stream's decode.
//
// Why: at one row dot512 is bound by the work of scaling the weights, not by their bytes (a Q4_K
// 16384 x 2048 product ran 21 G multiply-adds/s a core on Zen 4 whether its 18 MiB came from L2
// or from DRAM): per super-block 4 vpmovzxbw, 8 vpmullw and 8 broadcasts of group scales before
// 8 vpdpwssd meet one activation row. Here the weights stay bytes and the group scales meet the
// products instead:
//
//   - the int16 activations q = 256 hi + lo are split into two byte planes, lo unsigned and hi
//     signed, so vpmaddubsw multiplies 64 weight bytes with 64 activation bytes (pair sums in
//     int16: |lo w| <= 255 * 63 * 2 < 2^15 for 6-bit weights, no saturation);
//   - vpdpwssd multiplies each pair sum by its group's scale and adds pairs into int32 lanes;
//   - lane sum = lo lanes + (hi lanes << 8), in wrap-around int32 arithmetic, which is exact
//     because the true sum fits int32 (kquant_avx512.h's bound).
//
// The planes interleave each pair of 32-value chunks (2j, 2j + 1) two values at a time: bytes
// 4i .. 4i + 3 of plane vector j are values 2i, 2i + 1 of chunk 2j, then of chunk 2j + 1, so that
// int32 lane i sums exactly the values dot512's lane i sums (2i and 2i + 1 of every chunk), and
// the float32 tail (one FMA per super-block and row, the offsets in one more) is dot512's. So a
// row's result is bit-identical to the one dot512 and the many-rows path give it: batch invariance
// holds across the switch (tests/inflight_kernels/test_kquant_gemm.py checks it per format).
//
// Q6_K's weights are q - 32 (signed): the lo plane meets them biased (vpsubb once per block);
// the hi plane meets unsigned q and subtracts 32 times its pair sums (activation-only, made once
// per call in `ActivationPlanes::hi32`).
//
// Measured: bench/RESULTS.md run 44.

constexpr int64_t kPlaneRows = 2;  // activation rows up to which this path replaces dot_few_rows512

// The interleaved planes of up to kPlaneRows activation rows, each [k]: plane index
// 256 b + 64 j + 4 i + t holds value 256 b + 32 (2 j + t / 2) + 2 i + t % 2 of the row.
struct ActivationPlanes {
  std::vector<uint8_t> lo;    // low bytes of the int16 activations (unsigned)
  std::vector<int8_t> hi;     // high bytes (signed): q = 256 hi + lo
  std::vector<int16_t> hi32;  // [k / 2]: 32 (hi[2p] + hi[2p + 1]), the Q6_K bias's share of a pair
};

void make_planes(const Activations& a, int64_t m, ActivationPlanes& p) {
  const int64_t k = a.k;
  p.lo.resize(m * k);
  p.hi.resize(m * k);
  p.hi32.resize(m * k / 2);
  // int32 units (two values) of chunks 2j and 2j + 1 alternately, 8 units of each per vector
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t at = 0; at < m * k; at += 64) {  // k is a multiple of 256, so `at` starts a chunk pair
    const __m512i c0 = _mm512_loadu_si512(a.q.data() + at), c1 = _mm512_loadu_si512(a.q.data() + at + 32);
    const __m512i z[2] = {_mm512_permutex2var_epi32(c0, first, c1), _mm512_permutex2var_epi32(c0, second, c1)};
    for (int half = 0; half < 2; ++half) {
      const __m512i high = _mm512_srai_epi16(z[half], 8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.lo.data() + at + 32 * half), _mm512_cvtepi16_epi8(z[half]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.hi.data() + at + 32 * half), _mm512_cvtepi16_epi8(high));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.hi32.data() + (at + 32 * half) / 2),
                          _mm512_cvtepi32_epi16(_mm512_madd_epi16(high, _mm512_set1_epi16(32))));
    }
  }
}

// Lane 2i and 2i + 1 of chunk pair j's int16 scale vector: the groups of value 2i of chunks 2j and 2j + 1.
template <int Group>
struct PairScaleIndex {
  alignas(64) int16_t idx[4][32];
  constexpr PairScaleIndex() : idx() {
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) idx[j][l] = int16_t((32 * (2 * j + l % 2) + 2 * (l / 2)) / Group);
  }
};
constexpr PairScaleIndex<32> kPairIndex32{};
constexpr PairScaleIndex<16> kPairIndex16{};

KQ_INLINE __m512i pair_scales(const __m512i& scales16, int j, int group) {
  return _mm512_permutexvar_epi16(_mm512_load_si512(group == 32 ? kPairIndex32.idx[j] : kPairIndex16.idx[j]), scales16);
}

// Q4_K: chunk pair j is the 32 bytes at 16 + 32 j, chunk 2j in the low nibbles, 2j + 1 in the high.
// vpmovzxwd puts bytes 2i, 2i + 1 in lane i; (x | x << 12) & 0x0F0F0F0F moves their high nibbles
// to bytes 2 and 3.
struct Q4KPairs {
  static constexpr bool kSigned = false;
  static constexpr bool kOffsets = true;
  static constexpr int kGroup = 32;
  const uint8_t* w;
  int64_t bytes;
  // The 8 group scales as chunk pairs' int16 vectors, d, and the offsets dmin m (Q5_K's too).
  KQ_INLINE void scales(int64_t b, __m512i* sc, float& d, __m512& o) const {
    const uint8_t* block = w + b * bytes;
    const K4Packed packed = k4_packed(block);
    const __m512i scales16 =
        _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_cvtsi64_si128(int64_t(packed.scales))));
    for (int j = 0; j < 4; ++j) sc[j] = pair_scales(scales16, j, 32);
    d = half_at(block);
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(packed.mins))));
    o = _mm512_zextps256_ps512(_mm256_mul_ps(m, _mm256_set1_ps(half_at(block + 2))));
  }
  KQ_INLINE void load(int64_t b, __m512i* v, __m512i* sc, float& d, __m512& o) const {
    scales(b, sc, d, o);
    const uint8_t* block = w + b * bytes;
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i x = _mm512_cvtepu16_epi32(load32(block + 16 + 32 * j));
      v[j] = _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 12)), nibbles);
    }
  }
};

// Q5_K (layout at unpack_q5_k): Q4_K's nibbles from the 32 bytes at 48 + 32 j, and the fifth bit of
// value l of chunk 2j (2j + 1) from bit 2j (2j + 1) of byte l of the 32 bytes at 16: after
// vpmovzxwd and a shift right by 2j, bits 0, 8, 1 and 9 of lane i go to bit 4 of bytes 0 .. 3.
struct Q5KPairs {
  static constexpr bool kSigned = false;
  static constexpr bool kOffsets = true;
  static constexpr int kGroup = 32;
  const uint8_t* w;
  int64_t bytes;
  KQ_INLINE void load(int64_t b, __m512i* v, __m512i* sc, float& d, __m512& o) const {
    Q4KPairs{w, bytes}.scales(b, sc, d, o);
    const uint8_t* block = w + b * bytes;
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F), low_bits = _mm512_set1_epi32(0x00001010),
                  high_bits = _mm512_set1_epi32(0x10100000);
    const __m512i h = _mm512_cvtepu16_epi32(load32(block + 16));
    for (int j = 0; j < 4; ++j) {
      const __m512i x = _mm512_cvtepu16_epi32(load32(block + 48 + 32 * j));
      const __m512i bits = _mm512_srl_epi32(h, _mm_cvtsi32_si128(2 * j));
      const __m512i fifth = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(bits, 4), low_bits),
                                            _mm512_and_si512(_mm512_slli_epi32(bits, 19), high_bits));
      v[j] = _mm512_or_si512(_mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 12)), nibbles), fifth);
    }
  }
};

// Q6_K (layout at unpack_q6_k): in half h, the 64 low-nibble bytes hold chunks 4h and 4h + 1
// (low nibbles of bytes 0-31 and 32-63) and 4h + 2, 4h + 3 (high nibbles); one vpermw
// interleaves the two 32-byte halves two bytes at a time. The 32 bytes of high bit pairs hold,
// for value l of chunks 4h .. 4h + 3, bits 0-1 .. 6-7 of byte l; vpmovzxwd and two shifts
// put them above each nibble. v: the unsigned 6-bit q (0 .. 63).
struct Q6KPairs {
  static constexpr bool kSigned = true;
  static constexpr bool kOffsets = false;
  static constexpr int kGroup = 16;
  const uint8_t* w;
  int64_t bytes;
  KQ_INLINE void load(int64_t b, __m512i* v, __m512i* sc, float& d, __m512& o) const {
    const uint8_t* block = w + b * bytes;
    alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F), low_pairs = _mm512_set1_epi32(0x00003030),
                  high_pairs = _mm512_set1_epi32(0x30300000);
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(block + 64 * h));
      const __m512i y = _mm512_cvtepu16_epi32(load32(block + 128 + 32 * h));
      // chunks 4h, 4h + 1: high bits 0-1 of bytes 2i, 2i + 1, then bits 2-3, to bits 4-5 of bytes 0 .. 3
      const __m512i bits01 = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(y, 4), low_pairs),
                                             _mm512_and_si512(_mm512_slli_epi32(y, 18), high_pairs));
      // chunks 4h + 2, 4h + 3: bits 4-5, then 6-7
      const __m512i bits23 = _mm512_or_si512(_mm512_and_si512(y, low_pairs),
                                             _mm512_and_si512(_mm512_slli_epi32(y, 14), high_pairs));
      v[2 * h] = _mm512_or_si512(_mm512_and_si512(q, nibbles), bits01);
      v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, 4), nibbles), bits23);
    }
    const __m512i scales16 =
        _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192))));
    for (int j = 0; j < 4; ++j) sc[j] = pair_scales(scales16, j, 16);
    d = half_at(block + 208);
    o = _mm512_setzero_ps();
  }
};

KQ_INLINE __m512i dot_scaled_pairs(__m512i acc, __m512i pairs, __m512i scales) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, pairs, scales);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scales));
#endif
}

// acc[0 .. R) += activation rows 0 .. R - 1 against super-blocks 0 .. blocks - 1 of one row of W:
// dot512's lanes and tail, its integer sums made from the planes.
template <int R, class Source>
void dot_planes(const Source& src, int64_t blocks, const Activations& a, const ActivationPlanes& p, __m512* acc) {
  const int64_t k = a.k, nsb = k / kSuper, gk = k / Source::kGroup;
  const float* sums = a.sum(Source::kGroup);
  const __m512i bias = _mm512_set1_epi8(32);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_ahead(src.w, b, src.bytes);
    __m512i v[4], sc[4];
    float d;
    __m512 o;
    src.load(b, v, sc, d, o);
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i signed_v = Source::kSigned ? _mm512_sub_epi8(v[j], bias) : v[j];
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * k + b * kSuper + 64 * j;
        __m512i high = _mm512_maddubs_epi16(v[j], _mm512_loadu_si512(p.hi.data() + at));
        if (Source::kSigned) high = _mm512_sub_epi16(high, _mm512_loadu_si512(p.hi32.data() + at / 2));
        lo[r] = dot_scaled_pairs(lo[r], _mm512_maddubs_epi16(_mm512_loadu_si512(p.lo.data() + at), signed_v), sc[j]);
        hi[r] = dot_scaled_pairs(hi[r], high, sc[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i s = _mm512_add_epi32(lo[r], _mm512_slli_epi32(hi[r], 8));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * a.scale[r * nsb + b]), acc[r]);
      if (Source::kOffsets) {
        const float* xs = sums + r * gk + b * (kSuper / Source::kGroup);
        const __m512 xv = Source::kGroup == 32 ? _mm512_zextps256_ps512(_mm256_loadu_ps(xs)) : _mm512_loadu_ps(xs);
        acc[r] = _mm512_fnmadd_ps(o, xv, acc[r]);
      }
    }
  }
}

// One row of W against m <= kPlaneRows activation rows into out[r * os]; false (nothing written)
// when `type` has no planes path at m rows (Q2_K, Q3_K, Q6_K at two rows: dot_few_rows512).
bool dot_few_rows_planes(int64_t type, const uint8_t* w, int64_t bytes, int64_t blocks, const Activations& a,
                         const ActivationPlanes& p, int64_t m, float* out, int64_t os) {
  __m512 acc[kPlaneRows] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  switch (type) {
    case kQ4K:
      if (m == 1) dot_planes<1>(Q4KPairs{w, bytes}, blocks, a, p, acc);
      else dot_planes<2>(Q4KPairs{w, bytes}, blocks, a, p, acc);
      break;
    case kQ5K:
      if (m == 1) dot_planes<1>(Q5KPairs{w, bytes}, blocks, a, p, acc);
      else dot_planes<2>(Q5KPairs{w, bytes}, blocks, a, p, acc);
      break;
    case kQ6K:  // at two rows its extra hi32 loads and subtractions cost what the planes save
      if (m != 1) return false;
      dot_planes<1>(Q6KPairs{w, bytes}, blocks, a, p, acc);
      break;
    default: return false;
  }
  for (int64_t r = 0; r < m; ++r) out[r * os] = _mm512_reduce_add_ps(acc[r]);
  return true;
}
