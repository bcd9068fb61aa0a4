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
// The int32 group sums are exact; each group adds to a float32 accumulator in a fixed
// order, the same whatever the row count, so a row's result does not depend on the
// batch it runs in.
//
// Loop order: the rows of W are split between threads; a thread unpacks one row of W
// (all its super-blocks, 12 KB for K = 8192, kept in L1/L2) once and multiplies it with
// up to kRows activation rows at a time (each group of 16 values widened to int16 once for
// them), so the weights' bytes are read from memory once per step and their unpacking is
// paid once per row of W.
// CPUs without AVX2 run the same arithmetic in scalar code (same results up to the
// float32 order of the final sums).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_tiles.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using packed_tiles::from_half;

constexpr int64_t kSuper = 256;       // values per super-block
constexpr int64_t kActBlock = 32;     // activation values per int16 scale
constexpr int kRows = 4;              // activation rows per micro-kernel call
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

// One super-block in the common shape: w_i = scale[i / G] * u_i - offset[i / G], G the
// format's group size (only the first 256 / G scales and offsets are used).
struct Unpacked {
  alignas(32) uint8_t u[kSuper];
  alignas(32) float scale[16];
  alignas(32) float offset[16];
};

// Within every 32 values, weights and activations are stored with their second and third
// 8-value quarters swapped (natural quarters q0 q1 q2 q3 stored as q0 q2 q1 q3), so that
// widening 16 stored bytes gives values 0-7 in the low 128-bit lane and 16-23 in the high
// one: one vpmaddwd then sums groups of 16 into int32 lanes 0-3 (first 16 values) and 4-7
// (second 16), and a 16-value format's two scales apply to one vector. Sums over 32 values
// do not depend on the order.
inline int64_t stored_at(int64_t i) {
  const int64_t quarter = (i >> 3) & 3;
  return (i & ~int64_t(31)) | ((quarter == 1 ? 2 : quarter == 2 ? 1 : quarter) << 3) | (i & 7);
}

#if defined(__AVX2__)
inline void store_quarters_swapped(uint8_t* dst, __m256i v) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(v, _MM_SHUFFLE(3, 1, 2, 0)));
}
#endif

// A natural-order super-block of unpacked values (the scalar unpacks) stored swapped.
inline void store_natural(const uint8_t* natural, uint8_t* dst) {
  for (int64_t i = 0; i < kSuper; ++i) dst[stored_at(i)] = natural[i];
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
// three 32-bit words, times d and dmin.
inline void k4_scales(const uint8_t* block, Unpacked& out) {
  const float d = half_at(block), dmin = half_at(block + 2);
  uint32_t w[3];
  std::memcpy(w, block + 4, 12);
  const uint32_t sc[2] = {w[0] & 0x3f3f3f3fu, (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4)};
  const uint32_t mn[2] = {w[1] & 0x3f3f3f3fu, ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)};
  uint8_t scb[8], mnb[8];
  std::memcpy(scb, sc, 8);
  std::memcpy(mnb, mn, 8);
#if defined(__AVX2__)
  uint64_t s64, m64;
  std::memcpy(&s64, scb, 8);
  std::memcpy(&m64, mnb, 8);
  const __m256 sf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(s64))));
  const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m64))));
  _mm256_store_ps(out.scale, _mm256_mul_ps(sf, _mm256_set1_ps(d)));
  _mm256_store_ps(out.offset, _mm256_mul_ps(mf, _mm256_set1_ps(dmin)));
#else
  for (int j = 0; j < 8; ++j) {
    out.scale[j] = d * float(scb[j]);
    out.offset[j] = dmin * float(mnb[j]);
  }
#endif
}

// Q4_K: d, dmin (fp16), 12 bytes of scales, 128 bytes of nibbles. Byte l of chunk c
// holds value 64c + l in its low nibble and 64c + 32 + l in its high nibble.
void unpack_q4_k(const uint8_t* block, Unpacked& out) {
  k4_scales(block, out);
  const uint8_t* qs = block + 16;
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    store_quarters_swapped(out.u + 64 * c, _mm256_and_si256(v, low));
    store_quarters_swapped(out.u + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
  }
#else
  uint8_t natural[kSuper];
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      natural[64 * c + l] = qs[32 * c + l] & 0xF;
      natural[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  store_natural(natural, out.u);
#endif
}

// Q5_K: as Q4_K plus 32 bytes of fifth bits: bit 2c of byte l for value 64c + l,
// bit 2c + 1 for value 64c + 32 + l.
void unpack_q5_k(const uint8_t* block, Unpacked& out) {
  k4_scales(block, out);
  const uint8_t* qh = block + 16;
  const uint8_t* qs = block + 48;
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(0x10);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    const __m256i b0 = _mm256_set1_epi8(char(1 << (2 * c))), b1 = _mm256_set1_epi8(char(1 << (2 * c + 1)));
    const __m256i h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, b0), b0), sixteen);
    const __m256i h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, b1), b1), sixteen);
    store_quarters_swapped(out.u + 64 * c, _mm256_or_si256(_mm256_and_si256(v, low), h0));
    store_quarters_swapped(out.u + 64 * c + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), h1));
  }
#else
  uint8_t natural[kSuper];
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      natural[64 * c + l] = (qs[32 * c + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4);
      natural[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
    }
  store_natural(natural, out.u);
#endif
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed scales, d.
// In half h (128 values), byte l of ql (l < 64) and byte l % 32 of qh give values
// 128h + l (l < 32: low nibble, qh bits 0-1; l >= 32: low nibble, bits 2-3) and
// 128h + 64 + l (high nibble; bits 4-5 or 6-7).
void unpack_q6_k(const uint8_t* block, Unpacked& out) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
#if defined(__AVX2__)
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  const __m256 dv = _mm256_set1_ps(d), k32 = _mm256_set1_ps(32.0f);
  const __m256 s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)), dv);
  const __m256 s1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))), dv);
  _mm256_store_ps(out.scale, s0);
  _mm256_store_ps(out.scale + 8, s1);
  _mm256_store_ps(out.offset, _mm256_mul_ps(s0, k32));
  _mm256_store_ps(out.offset + 8, _mm256_mul_ps(s1, k32));
  const __m256i low = _mm256_set1_epi8(0x0F), bits = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
    uint8_t* u = out.u + 128 * h;
    // 16-bit shifts move bits across byte edges; each mask keeps only bits that stayed in their byte.
    store_quarters_swapped(u, _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits)));
    store_quarters_swapped(u + 32,
                           _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits)));
    store_quarters_swapped(u + 64,
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, bits)));
    store_quarters_swapped(u + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low),
                                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits)));
  }
#else
  for (int g = 0; g < 16; ++g) {
    out.scale[g] = d * float(sc[g]);
    out.offset[g] = 32.0f * out.scale[g];
  }
  uint8_t natural[kSuper];
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], hb = qh[32 * h + l];
      uint8_t* u = natural + 128 * h;
      u[l] = (a & 0xF) | ((hb & 3) << 4);
      u[l + 32] = (b & 0xF) | (((hb >> 2) & 3) << 4);
      u[l + 64] = (a >> 4) | (((hb >> 4) & 3) << 4);
      u[l + 96] = (b >> 4) | (((hb >> 6) & 3) << 4);
    }
  store_natural(natural, out.u);
#endif
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
  uint8_t natural[kSuper];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int q = (qs[32 * h + l] >> (2 * j)) & 3;
        const int high = (hmask[l] >> (4 * h + j)) & 1;
        natural[128 * h + 32 * j + l] = uint8_t(q + 4 * high);
      }
  store_natural(natural, out.u);
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
  uint8_t natural[kSuper];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) natural[128 * h + 32 * j + l] = uint8_t((qs[32 * h + l] >> (2 * j)) & 3);
  store_natural(natural, out.u);
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
// Simulated on SmolLM2-135M, teacher-forced against float32 activations (bench/RESULTS.md
// run 36): 16 bits per 256 values moved the next-token distribution by a mean KL of 2e-6
// nats; llama.cpp's Q8_K (int8 per 256) by 0.025, int8 per 32 by 0.005, bfloat16 by 1.3e-4.
// int16 products take vpmaddwd (16 per instruction) after widening the weights, which a
// 2-core Zen 2 ran faster than vpmaddubsw on split bytes: both multiplies share one pipe there.
struct Activations {
  std::vector<int16_t> q;
  std::vector<float> scale;           // [m, k / 256]
  std::vector<float> sum16, sum32;    // [m, k / 16], [m, k / 32]
  int64_t k = 0;

  const float* sum(int64_t g) const { return g == 16 ? sum16.data() : sum32.data(); }
};

void quantize_activations(const float* x, int64_t x_stride, int64_t m, int64_t k, Activations& a) {
  a.k = k;
  a.q.resize(m * k);
  a.scale.resize(m * (k / kSuper));
  a.sum16.resize(m * (k / 16));
  a.sum32.resize(m * (k / 32));
  at::parallel_for(0, m, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t b = 0; b < k / kSuper; ++b) {
        const float* v = x + r * x_stride + b * kSuper;
        float amax = 0.0f;
        for (int64_t i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float dx = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        a.scale[r * (k / kSuper) + b] = dx;
        const int64_t at = r * k + b * kSuper;
        for (int64_t g = 0; g < kSuper / 16; ++g) {
          int32_t s = 0;
          for (int64_t i = 16 * g; i < 16 * (g + 1); ++i) {
            const int16_t q = int16_t(std::nearbyint(std::clamp(v[i] * inv, -32767.0f, 32767.0f)));
            a.q[at + stored_at(i)] = q;
            s += q;
          }
          a.sum16[(at >> 4) + g] = dx * float(s);
        }
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

inline __m256i widen16(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// out[r] = the unpacked row w (blocks super-blocks, groups of G values) . activation row
// r0 + r, for R rows: per group one int32 vector of exact sums of u xq, turned to float32
// and multiplied by the group's scale into one of two partial sums of the super-block (even
// and odd groups), which are added to the row's total times the super-block's dx. The two
// short chains per super-block, not one chain over the whole row, let the core overlap
// consecutive super-blocks (an FMA's latency is 4-5 cycles); every row takes the same steps
// whatever R is.
template <int G, int R, class Source>
void dot_rows(const Source& w, int64_t blocks, const Activations& a, int64_t r0, float* out, int64_t out_stride) {
  constexpr int kGroups = kSuper / G;
  const int64_t k = a.k, gk = k / G;
  const float* sums = a.sum(G);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Unpacked& u = w(b);
    const int16_t* xq[R];
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      even[r] = odd[r] = _mm256_setzero_ps();
      const float* xs = sums + (r0 + r) * gk + b * kGroups;
      for (int h = 0; h < kGroups; h += 8)
        off[r] = _mm256_fmadd_ps(_mm256_load_ps(u.offset + h), _mm256_loadu_ps(xs + h), off[r]);
      xq[r] = a.q.data() + (r0 + r) * k + b * kSuper;
    }
    for (int c = 0; c < kSuper / 32; ++c) {
      // G = 32: one scale; G = 16: lanes 0-3 hold the first 16 values' sums, 4-7 the second's
      const __m256 sc = G == 32 ? _mm256_broadcast_ss(u.scale + c)
                                : _mm256_permutevar8x32_ps(_mm256_loadu_ps(u.scale + 2 * c), halves);
      const __m256i w0 = widen16(u.u + 32 * c), w1 = widen16(u.u + 32 * c + 16);
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, load16(xq[r] + 32 * c)),
                                           _mm256_madd_epi16(w1, load16(xq[r] + 32 * c + 16)));
        __m256& part = (c & 1) ? odd[r] : even[r];
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, part);
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(even[r], odd[r]), _mm256_set1_ps(a.scale[(r0 + r) * (k / kSuper) + b]),
                               acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) - hsum(off[r]);
}
#else
template <int G, int R, class Source>
void dot_rows(const Source& source, int64_t blocks, const Activations& a, int64_t r0, float* out, int64_t out_stride) {
  constexpr int kGroups = kSuper / G;
  const int64_t k = a.k, gk = k / G;
  std::vector<Unpacked> w(blocks);
  for (int64_t b = 0; b < blocks; ++b) w[b] = source(b);
  for (int r = 0; r < R; ++r) {
    float acc = 0.0f, off = 0.0f;
    const int16_t* xq = a.q.data() + (r0 + r) * k;
    const float* xs = a.sum(G) + (r0 + r) * gk;
    for (int64_t b = 0; b < blocks; ++b) {
      float part = 0.0f;
      for (int g = 0; g < kGroups; ++g) {
        int32_t s = 0;
        for (int i = 0; i < G; ++i) {
          const int64_t at = stored_at(G * g + i);
          s += int32_t(w[b].u[at]) * xq[b * kSuper + at];
        }
        part += float(s) * w[b].scale[g];
        off += w[b].offset[g] * xs[b * kGroups + g];
      }
      acc += part * a.scale[(r0 + r) * (k / kSuper) + b];
    }
    out[r * out_stride] = acc - off;
  }
}
#endif

// All m activation rows against one row of W (`bytes` bytes per super-block at `w`). A few
// rows (at most kRows) unpack each super-block just before its products, so that reading the
// next one overlaps them; more rows unpack the whole row into `buffer` first and reuse it
// for every kRows of them.
template <int G>
void dot_all_rows(const uint8_t* w, int64_t bytes, UnpackFn unpack, int64_t blocks, const Activations& a, int64_t m,
                  float* out, int64_t os, std::vector<Unpacked>& buffer) {
  if (m <= kRows) {
    Unpacked one;
    const auto streamed = [&](int64_t b) -> const Unpacked& {
#if defined(__AVX2__)
      // The rows of a part lie one after another: fetch kPrefetchBytes ahead, into the next
      // row at the end of this one, so DRAM reads stay in flight while this block computes.
      const char* ahead = reinterpret_cast<const char*>(w + b * bytes) + kPrefetchBytes;
      for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
#endif
      unpack(w + b * bytes, one);
      return one;
    };
    switch (m) {
      case 4: dot_rows<G, 4>(streamed, blocks, a, 0, out, os); break;
      case 3: dot_rows<G, 3>(streamed, blocks, a, 0, out, os); break;
      case 2: dot_rows<G, 2>(streamed, blocks, a, 0, out, os); break;
      default: dot_rows<G, 1>(streamed, blocks, a, 0, out, os); break;
    }
    return;
  }
  for (int64_t b = 0; b < blocks; ++b) unpack(w + b * bytes, buffer[b]);
  const auto buffered = [&](int64_t b) -> const Unpacked& { return buffer[b]; };
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) dot_rows<G, kRows>(buffered, blocks, a, r, out + r * os, os);
  switch (m - r) {
    case 3: dot_rows<G, 3>(buffered, blocks, a, r, out + r * os, os); break;
    case 2: dot_rows<G, 2>(buffered, blocks, a, r, out + r * os, os); break;
    case 1: dot_rows<G, 1>(buffered, blocks, a, r, out + r * os, os); break;
    default: break;
  }
}

struct Part {
  const uint8_t* data;
  int64_t rows, row_bytes, first_row, group, type;
  UnpackFn unpack;
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
    parts.push_back({t.data_ptr<uint8_t>(), t.size(0), t.stride(0), first, group_size(types[i]), types[i],
                     unpacker(types[i])});
    first += t.size(0);
  }
  TORCH_CHECK(first == n, "kquant_linear: the parts have ", first, " rows, out has ", n, " columns");
  return parts;
}

}  // namespace

// out float32 [M, N] (rows may be strided) = x @ W.T for x float32 [M, K] with contiguous
// rows, W the row-wise concatenation of `blocks` (uint8 [rows_i, K / 256 * bytes(type_i)],
// a GGUF tensor's bytes) of ggml types `types` (10..14: Q2_K..Q6_K).
void kquant_linear(at::Tensor out, at::Tensor x, std::vector<at::Tensor> blocks, std::vector<int64_t> types) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "kquant_linear: x must be a CPU float32 [M, K] with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "kquant_linear: out must be a CPU float32 [M, N] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), sblocks = k / kSuper;
  const std::vector<Part> parts = check_parts(blocks, types, k, n);
  if (m == 0) return;
  Activations a;
  quantize_activations(x.data_ptr<float>(), x.stride(0), m, k, a);
  float* op = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    std::vector<Unpacked> row(sblocks);
    for (int64_t col = first; col < last; ++col) {
      size_t p = 0;
      while (col >= parts[p].first_row + parts[p].rows) ++p;
      const Part& part = parts[p];
      const uint8_t* w = part.data + (col - part.first_row) * part.row_bytes;
      const int64_t bytes = block_bytes(part.type);
      if (part.group == 32) dot_all_rows<32>(w, bytes, part.unpack, sblocks, a, m, op + col, os, row);
      else dot_all_rows<16>(w, bytes, part.unpack, sblocks, a, m, op + col, os, row);
    }
  });
}

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
          dst[b * kSuper + j] = u.scale[j / group] * float(u.u[stored_at(j)]) - u.offset[j / group];
      }
    }
  });
}
