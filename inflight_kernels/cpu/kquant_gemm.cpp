// K-quant linear layers for the CPU: y = x @ W.T with W held in llama.cpp's K-quant
// super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) exactly as a GGUF file stores them, one
// row of super-blocks per output feature (the file's own bytes, memory-mapped by the
// loader), and never widened to float32 or bfloat16 in memory.
//
// A super-block holds 256 consecutive values of the reduction dimension. Each format
// (ggml-common.h's block_q*_K layouts, ggml-quants.c's dequantize_row_q*_K as the
// definition) is brought to one shape, 256 unsigned integers u in [0, 63] with a float
// scale s and offset o per group of 32 (Q4_K, Q5_K) or 16 values, w = s u - o:
//   Q4_K  u = 4-bit q,             s = d sc_j,    o = dmin m_j  (6-bit sc, m per 32 values)
//   Q5_K  u = 5-bit q,             s = d sc_j,    o = dmin m_j
//   Q6_K  u = 6-bit q,             s = d sc_g,    o = 32 s      (signed 8-bit sc per 16; q - 32)
//   Q3_K  u = 2-bit q + 4 hbit,    s = d (sc-32), o = 4 s       (6-bit sc per 16; q - 4 (1 - hbit))
//   Q2_K  u = 2-bit q,             s = d sc_g,    o = dmin m_g  (4-bit sc, m per 16)
// The activations are rounded to int16 with one float scale per super-block
// (dx = max|x| / 32767, a step of 2^-15 of the block's largest value), so that one
// product of 16 values is one vpmaddwd:
//   sum_i w_i x_i = dx sum_g s_g (sum_{i in g} u_i xq_i) - sum_g o_g (dx sum_{i in g} xq_i).
// The int32 group sums are exact; each super-block's group sums (one vector of 8 or two)
// meet the scales in one float32 FMA per row, in a fixed order, the same whatever the row
// count, so a row's result does not depend on the batch it runs in.
//
// Loop order: the rows of W are split between threads. For a few activation rows (at most
// kRows: one stream's decode, a short speculative verify), each super-block is unpacked in
// registers straight from the file's bytes and multiplied with every row, so the weights are
// read once and never stored again. For more rows a thread unpacks one row of W (all its
// super-blocks, 9 KB for K = 8192, kept in L1/L2) into the common shape once and multiplies
// it with kRows activation rows at a time. Both paths give the same values for the same block.
// CPUs without AVX2 run the same arithmetic in scalar code (same results up to the
// float32 order of the final sums). CPUs with AVX-512 F + BW run kquant_avx512.h instead,
// with the same loop order: the groups' integer scales multiplied into the weights, one
// int32 vector per super-block and no fold (1.3-1.5x faster at 32 rows, on par at one row,
// single thread on a Zen 5; its header has the arithmetic and the measurement); one row of Q4_K,
// Q5_K or Q6_K and two of Q4_K or Q5_K take kquant_planes.h there, the same integers from byte
// planes of the activations (1.1-1.2x at one row on Zen 4).

#include "aten_headers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_micro.h"
#include "packed_tiles.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
// AVX-512 F + BW: the products of kquant_avx512.h replace the AVX2 ones below.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__)
#define KQUANT_AVX512 1
#else
#define KQUANT_AVX512 0
#endif

namespace {

using packed_tiles::from_half;

constexpr int64_t kSuper = 256;       // values per super-block
constexpr int64_t kActBlock = 32;     // activation values per int16 scale
constexpr int64_t kRows = 4;          // activation rows per micro-kernel call
constexpr int64_t kColumnBlock = 16;  // rows of W unpacked together for a many-row product
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the products the weights are fetched

// ggml's type ids (ggml.h enum ggml_type) and bytes per super-block (ggml-common.h).
enum KType : int64_t { kQ2K = 10, kQ3K = 11, kQ4K = 12, kQ5K = 13, kQ6K = 14 };

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ2K: return 84;
    case kQ3K: return 110;
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    default: return 0;
  }
}

// Values per scale group: 32 for Q4_K and Q5_K, 16 for the others.
int64_t group_size(int64_t type) { return type == kQ4K || type == kQ5K ? 32 : 16; }

// One super-block in the common shape, natural value order: w_i = scale[i / G] * u_i -
// offset[i / G], G the format's group size (only the first 256 / G scales and offsets are
// used). The many-rows path keeps a whole row of W in this shape; the scalar unpacks (Q2_K,
// Q3_K, and every format without AVX2) write it for every path.
struct Unpacked {
  alignas(32) uint8_t u[kSuper];
  alignas(32) float scale[16];
  alignas(32) float offset[16];
};

// The activations are stored with the second and third 8-value quarters of every 32 values
// swapped (natural quarters q0 q1 q2 q3 stored as q0 q2 q1 q3): vpunpcklbw of 32 natural
// weight bytes with zero gives int16 values 0-7 and 16-23 (one per 128-bit lane), vpunpckhbw
// values 8-15 and 24-31, so each meets its activations with one aligned 16-value load.
inline int64_t stored_at(int64_t i) {
#if KQUANT_AVX512
  return i;  // kquant_avx512.h widens 32 bytes in natural order (vpmovzxbw)
#endif
  const int64_t quarter = (i >> 3) & 3;
  return (i & ~int64_t(31)) | ((quarter == 1 ? 2 : quarter == 2 ? 1 : quarter) << 3) | (i & 7);
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; c10's portable conversion costs a dozen
#else
  return from_half(h);
#endif
}

// Q4_K / Q5_K: the 8 6-bit scales and 8 6-bit minimums of the sub-blocks of 32 values from
// their 12 packed bytes (the layout of ggml-quants.c get_scale_min_k4: bytes 0-3 hold scales
// 0-3 and the top bits of scales 4-7, bytes 4-7 minimums 0-3 and the top bits of minimums
// 4-7, bytes 8-11 the low nibbles of scales 4-7 and, high, of minimums 4-7), worked on as
// three 32-bit words; byte j of `scales` (`mins`) is sub-block j's (little-endian).
struct K4Packed {
  uint64_t scales, mins;
};

inline K4Packed k4_packed(const uint8_t* block) {
  uint32_t w[3];
  std::memcpy(w, block + 4, 12);
  const uint32_t sc[2] = {w[0] & 0x3f3f3f3fu, (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4)};
  const uint32_t mn[2] = {w[1] & 0x3f3f3f3fu, ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)};
  return {uint64_t(sc[0]) | uint64_t(sc[1]) << 32, uint64_t(mn[0]) | uint64_t(mn[1]) << 32};
}

// `scale` = d sc, `offset` = dmin m (8 each).
inline void k4_scales(const uint8_t* block, float* scale, float* offset) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const K4Packed packed = k4_packed(block);
  uint8_t scb[8], mnb[8];
  std::memcpy(scb, &packed.scales, 8);
  std::memcpy(mnb, &packed.mins, 8);
  for (int j = 0; j < 8; ++j) {
    scale[j] = d * float(scb[j]);
    offset[j] = dmin * float(mnb[j]);
  }
}

// Q6_K's 16 signed 8-bit scales times d; the offset of the 6-bit values' bias of 32.
inline void k6_scales(const uint8_t* block, float* scale, float* offset) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  for (int g = 0; g < 16; ++g) {
    scale[g] = d * float(sc[g]);
    offset[g] = 32.0f * scale[g];
  }
}

// Natural-order unpacks in plain C++: the definition the AVX2 sources below follow, and what
// CPUs without AVX2 run. Q4_K: d, dmin (fp16), 12 bytes of scales, 128 bytes of nibbles; byte
// l of chunk c holds value 64c + l in its low nibble and 64c + 32 + l in its high nibble.
void unpack_q4_k(const uint8_t* block, Unpacked& out) {
  k4_scales(block, out.scale, out.offset);
  const uint8_t* qs = block + 16;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      out.u[64 * c + l] = qs[32 * c + l] & 0xF;
      out.u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
}

// Q5_K: as Q4_K plus 32 bytes of fifth bits: bit 2c of byte l for value 64c + l,
// bit 2c + 1 for value 64c + 32 + l.
void unpack_q5_k(const uint8_t* block, Unpacked& out) {
  k4_scales(block, out.scale, out.offset);
  const uint8_t* qh = block + 16;
  const uint8_t* qs = block + 48;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      out.u[64 * c + l] = (qs[32 * c + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4);
      out.u[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
    }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed scales, d.
// In half h (128 values), byte l of ql (l < 64) and byte l % 32 of qh give values
// 128h + l (l < 32: low nibble, qh bits 0-1; l >= 32: low nibble, bits 2-3) and
// 128h + 64 + l (high nibble; bits 4-5 or 6-7).
void unpack_q6_k(const uint8_t* block, Unpacked& out) {
  k6_scales(block, out.scale, out.offset);
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], hb = qh[32 * h + l];
      uint8_t* u = out.u + 128 * h;
      u[l] = (a & 0xF) | ((hb & 3) << 4);
      u[l + 32] = (b & 0xF) | (((hb >> 2) & 3) << 4);
      u[l + 64] = (a >> 4) | (((hb >> 4) & 3) << 4);
      u[l + 96] = (b >> 4) | (((hb >> 6) & 3) << 4);
    }
}

// Q3_K: 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, d.
// In half h, shift pair j (0..3) and l (0..31): value 128h + 32j + l is bits 2j of
// qs[32h + l], its high bit is bit 4h + j of hmask[l]; groups follow value order.
void unpack_q3_k(const uint8_t* block, Unpacked& out) {
  const uint8_t* hmask = block;
  const uint8_t* qs = block + 32;
  const uint8_t* packed = block + 96;
  const float d = half_at(block + 108);
  for (int g = 0; g < 16; ++g) {
    // 16 6-bit scales: low 4 bits from bytes 0..7 (low nibble for g < 8, high after),
    // top 2 bits from bytes 8..11 (ggml-quants.c dequantize_row_q3_K's kmask unpacking).
    const int lo = g < 8 ? packed[g] & 0xF : packed[g - 8] >> 4;
    const int hi = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
    out.scale[g] = d * float((lo | (hi << 4)) - 32);
    out.offset[g] = 4.0f * out.scale[g];
  }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int q = (qs[32 * h + l] >> (2 * j)) & 3;
        const int high = (hmask[l] >> (4 * h + j)) & 1;
        out.u[128 * h + 32 * j + l] = uint8_t(q + 4 * high);
      }
}

// Q2_K: 16 bytes of 4-bit scale and minimum pairs, 64 bytes of 2-bit values, d, dmin;
// value layout as Q3_K's.
void unpack_q2_k(const uint8_t* block, Unpacked& out) {
  const uint8_t* sc = block;
  const uint8_t* qs = block + 16;
  const float d = half_at(block + 80), dmin = half_at(block + 82);
  for (int g = 0; g < 16; ++g) {
    out.scale[g] = d * float(sc[g] & 0xF);
    out.offset[g] = dmin * float(sc[g] >> 4);
  }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) out.u[128 * h + 32 * j + l] = uint8_t((qs[32 * h + l] >> (2 * j)) & 3);
}

using UnpackFn = void (*)(const uint8_t*, Unpacked&);

UnpackFn unpacker(int64_t type) {
  switch (type) {
    case kQ2K: return unpack_q2_k;
    case kQ3K: return unpack_q3_k;
    case kQ4K: return unpack_q4_k;
    case kQ5K: return unpack_q5_k;
    case kQ6K: return unpack_q6_k;
    default: return nullptr;
  }
}

// Activation rows rounded to int16 with one float scale per 256 values (a super-block:
// dx = max|x| / 32767), and per group of 16 and of 32 values dx * sum(xq), for the offsets.
// Why 16 bits and not llama.cpp's 8 (Q8_K): bench/RESULTS.md run 36 (bench/activation_rounding.py)
// measured the next-token distribution's shift of each rounding on SmolLM2-135M.
struct Activations {
  std::vector<int16_t> q;
  std::vector<float> scale;           // [m, k / 256]
  std::vector<float> sum16, sum32;    // [m, k / 16], [m, k / 32]
  int64_t k = 0;

  const float* sum(int64_t g) const { return g == 16 ? sum16.data() : sum32.data(); }
};

#if defined(__AVX2__)
// One super-block of quantize_activations: its int16 values (at stored_at), its scale dx and its
// 16 group sums dx * sum q. In AVX2 the same values as the scalar loop below: max_ps keeps its second operand
// when the first is NaN, as std::max(amax, NaN) keeps amax; cvtps rounds half to even, as
// nearbyint in the default rounding mode; the int32 group sums are exact. (The scalar loop cost
// 2-4 ns a value, about 1 ms of a one-row decode step of a 1B model.)
inline void quantize_block(const float* v, int16_t* q, float* scale, float* sum16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < kSuper; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)));
  const float dx = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
  *scale = dx;
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(32767.0f), lo = _mm256_set1_ps(-32767.0f);
  for (int64_t g = 0; g < kSuper / 16; ++g) {
    __m256i s = _mm256_setzero_si256();
    for (int64_t u = 2 * g; u < 2 * g + 2; ++u) {  // 8-value units; stored_at moves whole units
      const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * u), vinv), lo), hi);
      const __m256i n = _mm256_cvtps_epi32(t);
      s = _mm256_add_epi32(s, n);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + stored_at(8 * u)),
                       _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1)));
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    sum16[g] = dx * float(_mm_cvtsi128_si32(t));
  }
}
#else
inline void quantize_block(const float* v, int16_t* q, float* scale, float* sum16) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float dx = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
  *scale = dx;
  for (int64_t g = 0; g < kSuper / 16; ++g) {
    int32_t s = 0;
    for (int64_t i = 16 * g; i < 16 * (g + 1); ++i) {
      const int16_t n = int16_t(std::nearbyint(std::clamp(v[i] * inv, -32767.0f, 32767.0f)));
      q[stored_at(i)] = n;
      s += n;
    }
    sum16[g] = dx * float(s);
  }
}
#endif

void quantize_activations(const float* x, int64_t x_stride, int64_t m, int64_t k, Activations& a) {
  a.k = k;
  a.q.resize(m * k);
  a.scale.resize(m * (k / kSuper));
  a.sum16.resize(m * (k / 16));
  a.sum32.resize(m * (k / 32));
  at::parallel_for(0, m, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t b = 0; b < k / kSuper; ++b) {
        const int64_t at = r * k + b * kSuper;
        quantize_block(x + r * x_stride + b * kSuper, a.q.data() + at, &a.scale[r * (k / kSuper) + b],
                       &a.sum16[at >> 4]);
        for (int64_t g = 0; g < kSuper / 32; ++g)
          a.sum32[(at >> 5) + g] = a.sum16[(at >> 4) + 2 * g] + a.sum16[(at >> 4) + 2 * g + 1];
      }
    }
  });
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Sources of super-blocks for dot_rows. Each gives, for super-block b, `chunk(b, c)`: values
// 32c..32c+31 (c < 8) as 32 natural-order bytes in [0, 63], and `scales(b, s, o)`: the
// scales and offsets of its groups in natural order (s[0], o[0]: groups 0-7; s[1], o[1]:
// groups 8-15 when G = 16). The File sources unpack the GGUF bytes in registers, the
// Buffered one reads an Unpacked row; both give the same values for the same block, so a
// row's result does not depend on which path ran it.

// Q4_K / Q5_K scales and offsets as two vectors (k4_scales' values, computed in registers).
inline void k4_scale_vectors(const uint8_t* block, __m256* s, __m256* o) {
  const K4Packed packed = k4_packed(block);
  s[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(packed.scales)))),
                       _mm256_set1_ps(half_at(block)));
  o[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(packed.mins)))),
                       _mm256_set1_ps(half_at(block + 2)));
}

// Q4_K from the file (layout at unpack_q4_k).
struct Q4KFile {
  const uint8_t* w;
  int64_t bytes;
  __m256i chunk(int64_t b, int c) const {
    const __m256i v = load32(w + b * bytes + 16 + 32 * (c >> 1)), low = _mm256_set1_epi8(0x0F);
    return c & 1 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
  }
  void scales(int64_t b, __m256* s, __m256* o) const { k4_scale_vectors(w + b * bytes, s, o); }
};

// Q5_K from the file (layout at unpack_q5_k): chunk c's fifth bits are bit c of qh.
struct Q5KFile {
  const uint8_t* w;
  int64_t bytes;
  __m256i chunk(int64_t b, int c) const {
    const uint8_t* block = w + b * bytes;
    const __m256i v = load32(block + 48 + 32 * (c >> 1)), low = _mm256_set1_epi8(0x0F);
    const __m256i bit = _mm256_set1_epi8(char(1 << c)), h = load32(block + 16);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(0x10));
    const __m256i nibble = c & 1 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
    return _mm256_or_si256(nibble, high);
  }
  void scales(int64_t b, __m256* s, __m256* o) const { k4_scale_vectors(w + b * bytes, s, o); }
};

// Q6_K from the file (layout at unpack_q6_k): chunk c is quarter c % 4 of half c / 4.
struct Q6KFile {
  const uint8_t* w;
  int64_t bytes;
  __m256i chunk(int64_t b, int c) const {
    const uint8_t* block = w + b * bytes;
    const int h = c >> 2, quarter = c & 3;
    const __m256i low = _mm256_set1_epi8(0x0F), bits = _mm256_set1_epi8(0x30);
    const __m256i q = load32(block + 64 * h + 32 * (quarter & 1)), hb = load32(block + 128 + 32 * h);
    // 16-bit shifts move bits across byte edges; each mask keeps only bits that stayed in their byte.
    const __m256i nibble = quarter < 2 ? _mm256_and_si256(q, low) : _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    __m256i high;
    switch (quarter) {
      case 0: high = _mm256_slli_epi16(hb, 4); break;
      case 1: high = _mm256_slli_epi16(hb, 2); break;
      case 2: high = hb; break;
      default: high = _mm256_srli_epi16(hb, 2); break;
    }
    return _mm256_or_si256(nibble, _mm256_and_si256(high, bits));
  }
  void scales(int64_t b, __m256* s, __m256* o) const {
    const uint8_t* block = w + b * bytes;
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m256 d = _mm256_set1_ps(half_at(block + 208)), k32 = _mm256_set1_ps(32.0f);
    s[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    s[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
    o[0] = _mm256_mul_ps(s[0], k32);
    o[1] = _mm256_mul_ps(s[1], k32);
  }
};

// A row already in the common shape (the many-rows path, and the scalar-unpacked formats).
struct Buffered {
  const Unpacked* row;
  __m256i chunk(int64_t b, int c) const {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(row[b].u + 32 * c));
  }
  void scales(int64_t b, __m256* s, __m256* o) const {
    for (int i = 0; i < 2; ++i) {
      s[i] = _mm256_load_ps(row[b].scale + 8 * i);
      o[i] = _mm256_load_ps(row[b].offset + 8 * i);
    }
  }
};

// Writes super-block b of an AVX2 source into the common shape.
template <int G, class Source>
void unpack_from(const Source& src, int64_t b, Unpacked& out) {
  for (int c = 0; c < kSuper / 32; ++c)
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.u + 32 * c), src.chunk(b, c));
  __m256 s[2], o[2];
  src.scales(b, s, o);
  for (int i = 0; i < (G == 16 ? 2 : 1); ++i) {
    _mm256_store_ps(out.scale + 8 * i, s[i]);
    _mm256_store_ps(out.offset + 8 * i, o[i]);
  }
}

// One activation row's running sums against one row of W: scaled products and offsets.
struct RowSums {
  __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  float total() const { return hsum(acc) - hsum(off); }
};

// sums_io[r] += row w (super-blocks b0 .. b1 - 1 from `src`, groups of G values) . activation row
// r0 + r, for R rows. Per 32 values, two vpmaddwd per row give int32 partial sums of u xq;
// horizontal adds (vphaddd) fold each group's partials into one exact int32 lane, so one
// super-block ends as one vector of its 8 group sums (G = 32; G = 16: two, groups in the
// order 0 2 4 6 1 3 5 7 that the folding leaves, which the scales are permuted to). That
// vector, turned to float32, meets the scales times the row's dx in one FMA into the row's
// accumulator; the offsets meet the activations' group sums in another. Each row takes the
// same steps whatever R is, and the integer sums are exact, so a row's result does not
// depend on its batch. The weights are unpacked once per 32 values for all R rows.
template <int G, int R, class Source>
void dot_rows(const Source& src, int64_t b0, int64_t b1, const Activations& a, int64_t r0, RowSums* sums_io,
              const uint8_t* prefetch = nullptr, int64_t prefetch_bytes = 0) {
  constexpr int kGroups = kSuper / G;
  const int64_t k = a.k, gk = k / G, nsb = k / kSuper;
  const float* sums = a.sum(G);
  const __m256i zero = _mm256_setzero_si256(), order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = sums_io[r].acc;
    off[r] = sums_io[r].off;
  }
  for (int64_t b = b0; b < b1; ++b) {
    if (prefetch != nullptr) {
      // The rows of a part lie one after another: fetch kPrefetchBytes ahead, into the next
      // row at the end of this one, so DRAM reads stay in flight while this block computes.
      const char* ahead = reinterpret_cast<const char*>(prefetch + b * prefetch_bytes) + kPrefetchBytes;
      for (int64_t line = 0; line < prefetch_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    __m256 s[2], o[2];
    src.scales(b, s, o);
    if (G == 16) {
      s[0] = _mm256_permutevar8x32_ps(s[0], order);
      s[1] = _mm256_permutevar8x32_ps(s[1], order);
    }
    const int16_t* xq[R];
    for (int r = 0; r < R; ++r) {
      const float* xs = sums + (r0 + r) * gk + b * kGroups;
      off[r] = _mm256_fmadd_ps(o[0], _mm256_loadu_ps(xs), off[r]);
      if (G == 16) off[r] = _mm256_fmadd_ps(o[1], _mm256_loadu_ps(xs + 8), off[r]);
      xq[r] = a.q.data() + (r0 + r) * k + b * kSuper;
    }
    __m256i folded[R][2];
    for (int half = 0; half < 2; ++half) {
      __m256i pairs[R][2];
      for (int pair = 0; pair < 2; ++pair) {
        const int c = 4 * half + 2 * pair;
        const __m256i u0 = src.chunk(b, c), u1 = src.chunk(b, c + 1);
        const __m256i a0 = _mm256_unpacklo_epi8(u0, zero), a1 = _mm256_unpackhi_epi8(u0, zero);
        const __m256i b0 = _mm256_unpacklo_epi8(u1, zero), b1 = _mm256_unpackhi_epi8(u1, zero);
        for (int r = 0; r < R; ++r) {
          const int16_t* x = xq[r] + 32 * c;
          const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(a0, load16(x)), _mm256_madd_epi16(a1, load16(x + 16)));
          const __m256i p1 =
              _mm256_add_epi32(_mm256_madd_epi16(b0, load16(x + 32)), _mm256_madd_epi16(b1, load16(x + 48)));
          pairs[r][pair] = _mm256_hadd_epi32(p0, p1);
        }
      }
      for (int r = 0; r < R; ++r) folded[r][half] = _mm256_hadd_epi32(pairs[r][0], pairs[r][1]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(a.scale[(r0 + r) * nsb + b]);
      if (G == 32) {
        // folded[half] lanes: 128-bit halves of groups 4 half .. 4 half + 3, low then high
        const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(folded[r][0], folded[r][1], 0x20),
                                             _mm256_permute2x128_si256(folded[r][0], folded[r][1], 0x31));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s[0], dx), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded[r][0]), _mm256_mul_ps(s[0], dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded[r][1]), _mm256_mul_ps(s[1], dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    sums_io[r].acc = acc[r];
    sums_io[r].off = off[r];
  }
}

// Rows r .. r + count - 1 (count <= kRows) over super-blocks b0 .. b1 - 1 of `src`.
template <int G, class Source>
void dot_count_rows(const Source& src, int64_t b0, int64_t b1, const Activations& a, int64_t r, int64_t count,
                    RowSums* sums, const uint8_t* prefetch = nullptr, int64_t prefetch_bytes = 0) {
  switch (count) {
    case 4: return dot_rows<G, 4>(src, b0, b1, a, r, sums, prefetch, prefetch_bytes);
    case 3: return dot_rows<G, 3>(src, b0, b1, a, r, sums, prefetch, prefetch_bytes);
    case 2: return dot_rows<G, 2>(src, b0, b1, a, r, sums, prefetch, prefetch_bytes);
    default: return dot_rows<G, 1>(src, b0, b1, a, r, sums, prefetch, prefetch_bytes);
  }
}

// All m (at most kRows) activation rows against one row of W (`w`, `bytes` per super-block)
// read through its format's AVX2 source: each super-block is unpacked in registers just
// before its products, and the file's bytes are read once.
template <int G, class Source>
void dot_file_rows(const Source& file, const uint8_t* w, int64_t bytes, int64_t blocks, const Activations& a,
                   int64_t m, float* out, int64_t os) {
  RowSums sums[kRows];
  dot_count_rows<G>(file, 0, blocks, a, 0, m, sums, w, bytes);
  for (int64_t r = 0; r < m; ++r) out[r * os] = sums[r].total();
}
#else
// Without AVX2: the same sums in scalar code, from the natural-order unpack.
template <int G>
void dot_row(const Unpacked* w, int64_t blocks, const Activations& a, int64_t r, float* out) {
  constexpr int kGroups = kSuper / G;
  const int64_t k = a.k, gk = k / G;
  float acc = 0.0f, off = 0.0f;
  const int16_t* xq = a.q.data() + r * k;
  const float* xs = a.sum(G) + r * gk;
  for (int64_t b = 0; b < blocks; ++b) {
    float part = 0.0f;
    for (int g = 0; g < kGroups; ++g) {
      int32_t s = 0;
      for (int i = G * g; i < G * (g + 1); ++i) s += int32_t(w[b].u[i]) * xq[b * kSuper + stored_at(i)];
      part += float(s) * w[b].scale[g];
      off += w[b].offset[g] * xs[b * kGroups + g];
    }
    acc += part * a.scale[r * (k / kSuper) + b];
  }
  *out = acc - off;
}
#endif

#if KQUANT_AVX512
#include "kquant_avx512.h"
#include "kquant_bf16.h"
#include "kquant_planes.h"
#endif
#ifndef KQUANT_BF16
#define KQUANT_BF16 0
#endif
#include "kquant_f32.h"

// One row of W (`w`, ggml type `type`, `bytes` per super-block) into the common shape.
void unpack_row(int64_t type, const uint8_t* w, int64_t bytes, int64_t blocks, Unpacked* out) {
#if defined(__AVX2__)
  switch (type) {
    case kQ4K: for (int64_t b = 0; b < blocks; ++b) unpack_from<32>(Q4KFile{w, bytes}, b, out[b]); return;
    case kQ5K: for (int64_t b = 0; b < blocks; ++b) unpack_from<32>(Q5KFile{w, bytes}, b, out[b]); return;
    case kQ6K: for (int64_t b = 0; b < blocks; ++b) unpack_from<16>(Q6KFile{w, bytes}, b, out[b]); return;
    default: break;  // Q2_K, Q3_K: the scalar unpack
  }
#endif
  const UnpackFn unpack = unpacker(type);
  for (int64_t b = 0; b < blocks; ++b) unpack(w + b * bytes, out[b]);
}

#if defined(__AVX2__)
// sums[0 .. count) += activation rows r0 .. r0 + count - 1 (count <= kRows) against super-blocks
// b0 .. b1 - 1 of one unpacked row of W of ggml type `type`.
void dot_unpacked(int64_t type, const Unpacked* row, int64_t b0, int64_t b1, const Activations& a, int64_t r0,
                  int64_t count, RowSums* sums) {
  if (group_size(type) == 32) dot_count_rows<32>(Buffered{row}, b0, b1, a, r0, count, sums);
  else dot_count_rows<16>(Buffered{row}, b0, b1, a, r0, count, sums);
}
#endif

// Activation rows r0 .. r0 + count - 1 (count <= kRows) against one whole unpacked row of W.
void dot_unpacked_rows(int64_t type, const Unpacked* row, int64_t blocks, const Activations& a, int64_t r0,
                       int64_t count, float* out, int64_t os) {
#if defined(__AVX2__)
  RowSums sums[kRows];
  dot_unpacked(type, row, 0, blocks, a, r0, count, sums);
  for (int64_t r = 0; r < count; ++r) out[(r0 + r) * os] = sums[r].total();
#else
  for (int64_t r = r0; r < r0 + count; ++r) {
    if (group_size(type) == 32) dot_row<32>(row, blocks, a, r, out + r * os);
    else dot_row<16>(row, blocks, a, r, out + r * os);
  }
#endif
}

// A few (at most kRows) activation rows against one row of W, straight from the file's bytes
// where the format has an AVX2 source.
void dot_few_rows(int64_t type, const uint8_t* w, int64_t bytes, int64_t blocks, const Activations& a, int64_t m,
                  float* out, int64_t os, Unpacked* buffer) {
#if defined(__AVX2__)
  switch (type) {
    case kQ4K: return dot_file_rows<32>(Q4KFile{w, bytes}, w, bytes, blocks, a, m, out, os);
    case kQ5K: return dot_file_rows<32>(Q5KFile{w, bytes}, w, bytes, blocks, a, m, out, os);
    case kQ6K: return dot_file_rows<16>(Q6KFile{w, bytes}, w, bytes, blocks, a, m, out, os);
    default: break;
  }
#endif
  unpack_row(type, w, bytes, blocks, buffer);
  dot_unpacked_rows(type, buffer, blocks, a, 0, m, out, os);
}

struct Part {
  const uint8_t* data;
  int64_t rows, row_bytes, first_row, type;
};

std::vector<Part> check_parts(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types, int64_t k,
                              int64_t n) {
  TORCH_CHECK(blocks.size() == types.size() && !blocks.empty(), "kquant_linear: one type per part");
  TORCH_CHECK(k % kSuper == 0, "kquant_linear: K=", k, " is not a multiple of 256");
  std::vector<Part> parts;
  int64_t first = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& t = blocks[i];
    const int64_t bytes = block_bytes(types[i]);
    TORCH_CHECK(bytes > 0, "kquant_linear: unknown K-quant type id ", types[i]);
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 2 && t.stride(1) == 1,
                "kquant_linear: part ", i, " must be a CPU uint8 [rows, row_bytes] with contiguous rows");
    TORCH_CHECK(t.size(1) == k / kSuper * bytes, "kquant_linear: part ", i, " has ", t.size(1),
                " bytes per row, expected ", k / kSuper * bytes, " for K=", k);
    parts.push_back({t.data_ptr<uint8_t>(), t.size(0), t.stride(0), first, types[i]});
    first += t.size(0);
  }
  TORCH_CHECK(first == n, "kquant_linear: the parts have ", first, " rows, out has ", n, " columns");
  return parts;
}

}  // namespace

// out float32 [M, N] (rows may be strided) = x @ W.T for x float32 [M, K] with contiguous
// rows, W the row-wise concatenation of `blocks` (uint8 [rows_i, K / 256 * bytes(type_i)],
// a GGUF tensor's bytes) of ggml types `types` (10..14: Q2_K..Q6_K). With dense_min_rows > 0,
// a product of at least that many rows runs through bfloat16 tiles where the build has AVX-512
// BF16 (kquant_bf16.h; kquant_bf16_compiled()), else in int16 as every smaller one.
void kquant_linear(at::Tensor out, at::Tensor x, std::vector<at::Tensor> blocks, std::vector<int64_t> types,
                   int64_t dense_min_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "kquant_linear: x must be a CPU float32 [M, K] with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "kquant_linear: out must be a CPU float32 [M, N] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), sblocks = k / kSuper;
  const std::vector<Part> parts = check_parts(blocks, types, k, n);
  if (m == 0) return;
  float* op = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  const auto part_of = [&](int64_t col) -> const Part& {
    size_t p = 0;
    while (col >= parts[p].first_row + parts[p].rows) ++p;
    return parts[p];
  };
  // Row `col` of W as its file bytes and type.
  const auto row_of = [&](int64_t col, const uint8_t*& row, int64_t& type) {
    const Part& part = part_of(col);
    row = part.data + (col - part.first_row) * part.row_bytes;
    type = part.type;
  };
#if KQUANT_BF16
  if (dense_min_rows > 0 && m >= dense_min_rows) {
    kquant_bf16_product(x.data_ptr<float>(), x.stride(0), m, k, n, row_of, op, os);
    return;
  }
#elif KQUANT_F32
  if (dense_min_rows > 0 && m >= dense_min_rows) {
    kquant_f32_product(x.data_ptr<float>(), x.stride(0), m, k, n, row_of, op, os);
    return;
  }
#endif
  Activations a;
  quantize_activations(x.data_ptr<float>(), x.stride(0), m, k, a);
#if KQUANT_AVX512
  if (m <= kRows) {
    ActivationPlanes planes;  // one or two rows: kquant_planes.h where the type has it, the same values
    if (m <= kPlaneRows) make_planes(a, m, planes);
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      std::vector<Scaled> row(sblocks);  // Q2_K and Q3_K only
      for (int64_t col = first; col < last; ++col) {
        const uint8_t* w;
        int64_t type;
        row_of(col, w, type);
        if (m > kPlaneRows || !dot_few_rows_planes(type, w, block_bytes(type), sblocks, a, planes, m, op + col, os))
          dot_few_rows512(type, w, block_bytes(type), sblocks, a, m, op + col, os, row.data());
      }
    });
    return;
  }
  // Many rows: as below, with the rows of W scaled (kquant_avx512.h) and kRows512 activation rows a call.
  at::parallel_for(0, (n + kColumnBlock - 1) / kColumnBlock, 1, [&](int64_t first, int64_t last) {
    std::vector<Scaled> rows(kColumnBlock * sblocks);
    for (int64_t cb = first; cb < last; ++cb) {
      const int64_t c0 = cb * kColumnBlock, c1 = std::min(n, c0 + kColumnBlock);
      int64_t type[kColumnBlock];
      for (int64_t col = c0; col < c1; ++col) {
        const uint8_t* w;
        row_of(col, w, type[col - c0]);
        scale_row(type[col - c0], w, block_bytes(type[col - c0]), sblocks, rows.data() + (col - c0) * sblocks);
      }
      dot_many_rows512(type, rows.data(), sblocks, c0, c1, a, m, op, os);
    }
  });
#else
  if (m <= kRows) {
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      std::vector<Unpacked> row(sblocks);
      for (int64_t col = first; col < last; ++col) {
        const uint8_t* w;
        int64_t type;
        row_of(col, w, type);
        dot_few_rows(type, w, block_bytes(type), sblocks, a, m, op + col, os, row.data());
      }
    });
    return;
  }
  // Many rows (a prefill): kColumnBlock rows of W are unpacked together (into L2), and each
  // kRows activation rows meet all of them in turn, so the activations are read from the outer
  // caches once per kColumnBlock rows of W, not once per row (1.3-1.4x faster at 256 rows and
  // K = 8192 in a single-thread harness). Splitting K as well gained nothing more there.
  const int64_t column_blocks = (n + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(0, column_blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<Unpacked> rows(kColumnBlock * sblocks);
    for (int64_t cb = first; cb < last; ++cb) {
      const int64_t c0 = cb * kColumnBlock, c1 = std::min(n, c0 + kColumnBlock);
      int64_t type[kColumnBlock];
      for (int64_t col = c0; col < c1; ++col) {
        const uint8_t* w;
        row_of(col, w, type[col - c0]);
        unpack_row(type[col - c0], w, block_bytes(type[col - c0]), sblocks, rows.data() + (col - c0) * sblocks);
      }
      for (int64_t r = 0; r < m; r += kRows) {
        const int64_t count = std::min(kRows, m - r);
        for (int64_t col = c0; col < c1; ++col)
          dot_unpacked_rows(type[col - c0], rows.data() + (col - c0) * sblocks, sblocks, a, r, count, op + col, os);
      }
    }
  });
#endif
}

bool kquant_bf16_compiled() { return KQUANT_BF16 != 0; }

bool kquant_f32_compiled() { return KQUANT_F32 != 0; }

// out float32 [len(ids), K] = rows `ids` of a K-quant tensor (uint8 [N, K / 256 * bytes]),
// dequantized: the token embedding's lookup when the file keeps it in K-quant blocks.
void kquant_dequantize_rows(at::Tensor out, at::Tensor blocks, int64_t type, at::Tensor ids) {
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(bytes > 0, "kquant_dequantize_rows: unknown K-quant type id ", type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 &&
                  blocks.size(1) % bytes == 0,
              "kquant_dequantize_rows: blocks must be uint8 [N, K / 256 * ", bytes, "] with contiguous rows");
  const int64_t k = blocks.size(1) / bytes * kSuper;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(1) == k &&
                  ids.scalar_type() == at::kLong && ids.dim() == 1 && out.size(0) == ids.size(0),
              "kquant_dequantize_rows: out must be contiguous float32 [len(ids), ", k, "], ids int64 [n]");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < blocks.size(0), "kquant_dequantize_rows: id ", idp[i], " out of range");
  const UnpackFn unpack = unpacker(type);
  const int64_t group = group_size(type);
  at::parallel_for(0, ids.size(0), 1, [&](int64_t first, int64_t last) {
    Unpacked u;
    for (int64_t i = first; i < last; ++i) {
      const uint8_t* w = blocks.data_ptr<uint8_t>() + idp[i] * blocks.stride(0);
      float* dst = out.data_ptr<float>() + i * k;
      for (int64_t b = 0; b < k / kSuper; ++b) {
        unpack(w + b * bytes, u);
        for (int64_t j = 0; j < kSuper; ++j)
          dst[b * kSuper + j] = u.scale[j / group] * float(u.u[j]) - u.offset[j / group];
      }
    }
  });
}
