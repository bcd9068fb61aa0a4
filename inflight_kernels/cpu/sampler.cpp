// Fused token sampling for the CPU: one pass per row instead of the torch
// sampler's chain of softmax / log-sum-exp / topk / cumsum / searchsorted ops
// (worker/engine/sampler.py, whose torch path stays the fallback and the
// definition this code follows).
//
// Per row r of `logits` (the batch row rows[r]), with temperature t, min-p
// floor log(min_p), top-k k (0 = off) and top-p p (>= 1 = off), and the row's
// uniform u in [0, 1):
//   s_i = x_i / t (float32, as torch divides); m = max s_i; tokens with
//   s_i < m + float(log(min_p)) are dropped (min-p, float32 arithmetic as torch).
//   No top-k / top-p: the first token, in vocabulary order, whose cumulative
//   exp(s_i - m) reaches u times the row's sum (inverse transform sampling).
//   Otherwise, tokens in descending order of s: the first k (top-k); then the
//   shortest prefix whose mass (normalized over the top-k survivors, or over
//   the whole row without a top-k) before a token is < p keeps that token
//   (top-p; the first token always stays); then the same inverse transform
//   over the kept prefix, in that descending order.
//
// No sort of the vocabulary. Two passes over a row: its max, then s, exp(s - m)
// and their sum (with a top-p, also the mass above four thresholds 2, 4, 6 and
// 8 nats below the max, and the tokens above the last). The kept tokens lie
// above a threshold xi on the raw logits (x >= xi is an upper set of s as well:
// x -> x / t is monotone) holding at least p of the mass, or at least k tokens
// for a top-k; usually one of the four, else found by vectorized counting
// passes (doubling, then bisection). Only the tokens above it are sorted (by
// logit, then index). Rows are split between torch's intra-op threads with
// at::parallel_for. exp is the polynomial of scalar.h / simd_exp.h (std::exp
// for top-k sets); sums are float32 vector lanes per chunk of 512, then double.
// The token agrees with the torch path's except where u or p lies within float
// rounding of a cumulative-probability boundary (tests/kernels/test_cpu_sampler.py).
//
// Scalar C++ where neither AVX-512 nor AVX2 + FMA is built (still faster than
// the torch path); vector loops on the `Simd` lanes of simd_avx512.h /
// simd_avx2.h otherwise.

#include "aten_headers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "scalar.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define INFLIGHT_SAMPLER_SIMD 1
#endif

namespace {

#if defined(__AVX512F__)
#include "simd_avx512.h"
#include "simd_exp.h"
using Mask = __mmask16;
inline Mask ge(Simd::R a, Simd::R b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Mask gt(Simd::R a, Simd::R b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask both(Mask a, Mask b) { return a & b; }
inline Simd::R keep(Mask m, Simd::R v) { return _mm512_maskz_mov_ps(m, v); }
inline Simd::R add_if(Simd::R acc, Mask m, Simd::R v) { return _mm512_mask_add_ps(acc, m, acc, v); }
inline uint32_t bits(Mask m) { return static_cast<uint32_t>(m); }
#elif defined(INFLIGHT_SAMPLER_SIMD)
#include "simd_avx2.h"
#include "simd_exp.h"
using Mask = __m256;
inline Mask ge(Simd::R a, Simd::R b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
inline Mask gt(Simd::R a, Simd::R b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
inline Simd::R keep(Mask m, Simd::R v) { return _mm256_and_ps(m, v); }
inline Simd::R add_if(Simd::R acc, Mask m, Simd::R v) { return _mm256_add_ps(acc, _mm256_and_ps(m, v)); }
inline uint32_t bits(Mask m) { return static_cast<uint32_t>(_mm256_movemask_ps(m)); }
#endif

#if defined(INFLIGHT_SAMPLER_SIMD)
constexpr int64_t kLanes = Simd::W;

// x / t rounded exactly as a division, from the reciprocal r = 1/t (rounded)
// and one FMA correction (Markstein's theorem: q + (x - q t) r rounds to the
// correctly rounded quotient while nothing under- or overflows), at a fraction of
// the cost of vdivps. An infinite x gives NaN, which every caller drops like -inf.
inline Simd::R divide(Simd::R x, Simd::R r, Simd::R neg_t) {
  const Simd::R q = Simd::mul(x, r);
  return Simd::fmadd(Simd::fmadd(q, neg_t, x), r, q);
}
#else
constexpr int64_t kLanes = 1;
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLowest = std::numeric_limits<float>::lowest();  // a floor that drops -inf and NaN
constexpr int64_t kChunk = 512;      // elements per partial sum of the vocabulary-order walk
constexpr int64_t kFewCandidates = 256;  // stop narrowing the threshold below this many candidates
constexpr float kFirstGap = 4.0f;    // first threshold: the max scaled logit minus this (nats)
constexpr float kLastGap = 128.0f;   // beyond this gap every token is a candidate (exp(-128) ~ 0)

// Per-thread scratch, kept between calls (no allocation or page faults per row).
struct Scratch {
  std::vector<float> e;         // exp(s_i - m) of the row, 0 for dropped tokens
  std::vector<double> chunk;    // sums of e per kChunk elements
  std::vector<uint64_t> keys;   // candidates: descending logit, then ascending index
  std::vector<double> mass;     // candidates' exp(s - m)
  std::vector<double> cum;      // and its running sums
};
thread_local Scratch scratch;

inline float row_max(const float* x, int64_t n) {
  float m = kNegInf;
  int64_t i = 0;
#if defined(INFLIGHT_SAMPLER_SIMD)
  Simd::R acc = Simd::set1(kNegInf);
  for (; i + kLanes <= n; i += kLanes) acc = Simd::max(Simd::loadu(x + i), acc);  // a NaN lane keeps acc
  m = Simd::reduce_max(acc);
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// What the top-p path learns during the exp pass: the mass of the tokens with
// x >= xi[j] for a few gaps below the maximum, and the tokens of the widest gap
// (unless more than kCollectCap of them: then `overflow`).
constexpr int kGaps = 4;
constexpr float kGapNats[kGaps] = {2.0f, 4.0f, 6.0f, 8.0f};
constexpr size_t kCollectCap = 4096;
struct GapStats {
  float xi[kGaps];
  double mass[kGaps] = {0.0, 0.0, 0.0, 0.0};
  bool overflow = false;
};

// Sort key: ascending keys = descending x, then ascending index.
inline uint64_t key_of(float x, int64_t index) {
  uint32_t b;
  const float z = x + 0.0f;  // -0 -> +0
  std::memcpy(&b, &z, sizeof b);
  const uint32_t ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending with x
  return (static_cast<uint64_t>(~ordered) << 32) | static_cast<uint32_t>(index);
}
inline int64_t index_of(uint64_t key) { return static_cast<int64_t>(key & 0xffffffffu); }

// e[i] = exp(x_i / t - m) where x_i / t >= floor, else 0; chunk[c] = the sum of
// chunk c. Returns the double sum of the chunks. With `stats`, also the gap
// masses and the widest gap's tokens (appended to keys).
template <bool kStats>
double exp_pass(const float* x, int64_t n, float t, float m, float floor, float* e, double* chunk, GapStats* stats,
                std::vector<uint64_t>* keys) {
  double total = 0.0;
  for (int64_t c = 0, start = 0; start < n; ++c, start += kChunk) {
    const int64_t end = std::min(n, start + kChunk);
    int64_t i = start;
    float part = 0.0f;
    float gap_part[kGaps] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(INFLIGHT_SAMPLER_SIMD)
    const Simd::R vr = Simd::set1(1.0f / t), vnt = Simd::set1(-t), vm = Simd::set1(m), vf = Simd::set1(floor);
    Simd::R acc = Simd::zero();
    Simd::R gap_acc[kGaps], gap_xi[kGaps];
    if constexpr (kStats) {
      for (int j = 0; j < kGaps; ++j) {
        gap_acc[j] = Simd::zero();
        gap_xi[j] = Simd::set1(stats->xi[j]);
      }
    }
    for (; i + kLanes <= end; i += kLanes) {
      const Simd::R xv = Simd::loadu(x + i);
      const Simd::R s = divide(xv, vr, vnt);
      const Mask live = ge(s, vf);
      const Simd::R v = keep(live, vexp<Simd>(Simd::sub(s, vm)));
      Simd::storeu(e + i, v);
      acc = Simd::add(acc, v);
      if constexpr (kStats) {
        for (int j = 0; j < kGaps; ++j) gap_acc[j] = add_if(gap_acc[j], ge(xv, gap_xi[j]), v);
        uint32_t b = bits(both(ge(xv, gap_xi[kGaps - 1]), live));
        if (b != 0 && !stats->overflow) {
          for (; b != 0; b &= b - 1) {
            const int64_t k = i + __builtin_ctz(b);
            keys->push_back(key_of(x[k], k));
          }
          stats->overflow = keys->size() > kCollectCap;
        }
      }
    }
    part = Simd::reduce_add(acc);
    if constexpr (kStats) {
      for (int j = 0; j < kGaps; ++j) gap_part[j] = Simd::reduce_add(gap_acc[j]);
    }
#endif
    for (; i < end; ++i) {
      const float s = x[i] / t;
      e[i] = s >= floor ? inflight_cpu::exp_approx(s - m) : 0.0f;
      part += e[i];
      if constexpr (kStats) {
        for (int j = 0; j < kGaps; ++j) gap_part[j] += x[i] >= stats->xi[j] ? e[i] : 0.0f;
        if (x[i] >= stats->xi[kGaps - 1] && e[i] > 0.0f && !stats->overflow) {
          keys->push_back(key_of(x[i], i));
          stats->overflow = keys->size() > kCollectCap;
        }
      }
    }
    chunk[c] = part;
    total += part;
    if constexpr (kStats) {
      for (int j = 0; j < kGaps; ++j) stats->mass[j] += gap_part[j];
    }
  }
  return total;
}

// Mass (sum of e) and number of kept tokens (e > 0) with x >= xi.
double mass_above(const float* x, const float* e, int64_t n, float xi, int64_t* count) {
  double mass = 0.0;
  int64_t found = 0;
  int64_t i = 0;
#if defined(INFLIGHT_SAMPLER_SIMD)
  const Simd::R vx = Simd::set1(xi), zero = Simd::zero();
  Simd::R acc = Simd::zero();
  for (; i + kLanes <= n; i += kLanes) {
    const Simd::R ev = Simd::loadu(e + i);
    const Mask in = both(ge(Simd::loadu(x + i), vx), gt(ev, zero));
    acc = add_if(acc, in, ev);
    found += __builtin_popcount(bits(in));
  }
  mass = Simd::reduce_add(acc);
#endif
  for (; i < n; ++i) {
    if (x[i] >= xi && e[i] > 0.0f) {
      mass += e[i];
      ++found;
    }
  }
  *count = found;
  return mass;
}

int64_t count_above(const float* x, int64_t n, float xi) {
  int64_t found = 0;
  int64_t i = 0;
#if defined(INFLIGHT_SAMPLER_SIMD)
  const Simd::R vx = Simd::set1(xi);
  for (; i + kLanes <= n; i += kLanes) found += __builtin_popcount(bits(ge(Simd::loadu(x + i), vx)));
#endif
  for (; i < n; ++i) found += x[i] >= xi;
  return found;
}

// Append the tokens with x >= xi (and e > 0 when e is given) to keys.
void collect(const float* x, const float* e, int64_t n, float xi, std::vector<uint64_t>& keys) {
  int64_t i = 0;
#if defined(INFLIGHT_SAMPLER_SIMD)
  const Simd::R vx = Simd::set1(xi), zero = Simd::zero();
  for (; i + kLanes <= n; i += kLanes) {
    Mask in = ge(Simd::loadu(x + i), vx);
    if (e != nullptr) in = both(in, gt(Simd::loadu(e + i), zero));
    for (uint32_t b = bits(in); b != 0; b &= b - 1) {
      const int64_t j = i + __builtin_ctz(b);
      keys.push_back(key_of(x[j], j));
    }
  }
#endif
  for (; i < n; ++i)
    if (x[i] >= xi && (e == nullptr || e[i] > 0.0f)) keys.push_back(key_of(x[i], i));
}

// Inverse transform in vocabulary order over e, with chunk sums: the first
// token whose running sum reaches target; -1 when the row has no mass.
int64_t draw_in_order(const float* e, const double* chunk, int64_t n, double target) {
  double cum = 0.0;
  int64_t last_chunk = -1;
  for (int64_t c = 0, start = 0; start < n; ++c, start += kChunk) {
    if (!(chunk[c] > 0.0)) continue;
    last_chunk = c;
    if (cum + chunk[c] < target) {
      cum += chunk[c];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = start, end = std::min(n, start + kChunk); i < end; ++i) {
      if (e[i] > 0.0f) {
        cum += e[i];
        last = i;
        if (cum >= target) return i;
      }
    }
    return last;  // the element sums fell short of the chunk sum by rounding
  }
  if (last_chunk < 0) return -1;
  for (int64_t i = std::min(n, (last_chunk + 1) * kChunk) - 1; i >= last_chunk * kChunk; --i)
    if (e[i] > 0.0f) return i;
  return -1;
}

// Top-p over the sorted candidates' masses (normalized by norm), then the
// inverse transform over the kept prefix. Returns the position in the list,
// or -1 when every candidate is kept with mass < p before the next one
// (the nucleus may continue past the list: the caller widens it).
int64_t nucleus_draw(const std::vector<double>& mass, std::vector<double>& cum, double norm, float top_p,
                     double u, bool complete) {
  const int64_t n = static_cast<int64_t>(mass.size());
  const double limit = static_cast<double>(top_p) * norm;
  cum.resize(n);
  double run = 0.0;
  int64_t kept = 0;
  for (; kept < n; ++kept) {
    if (kept > 0 && top_p < 1.0f && run >= limit) break;
    run += mass[kept];
    cum[kept] = run;
  }
  if (kept == n && !complete && top_p < 1.0f && run < limit) return -1;
  const double target = u * run;
  int64_t last = 0;
  for (int64_t r = 0; r < kept; ++r) {
    if (mass[r] > 0.0) {
      last = r;
      if (cum[r] >= target) return r;
    }
  }
  return last;
}

// One row; see the top of the file. Returns the token id.
int64_t sample_row(const float* x, int64_t n, float t, double log_min_p, int64_t top_k, float top_p, double u) {
  const float xmax = row_max(x, n);
  if (!(xmax > kNegInf)) return 0;  // no finite logit: nothing to draw from
  const float m = xmax / t;
  float floor = kLowest;
  if (log_min_p > -std::numeric_limits<double>::infinity()) floor = std::max(kLowest, m + static_cast<float>(log_min_p));
  const bool has_k = top_k > 0 && top_k < n;
  const bool truncated = has_k || top_p < 1.0f;
  Scratch& sc = scratch;
  sc.keys.clear();
  sc.mass.clear();

  if (has_k) {
    // Fewest tokens x >= xi numbering at least k: gaps doubled from kFirstGap, then halved back.
    float lo = 0.0f, hi = kFirstGap;
    int64_t found = count_above(x, n, xmax - hi * t);
    while (found < top_k && hi < kLastGap) {
      lo = hi;
      hi *= 2.0f;
      found = count_above(x, n, xmax - hi * t);
    }
    float xi = found >= top_k ? xmax - hi * t : kNegInf;
    for (int step = 0; step < 8 && found >= top_k && found > 2 * top_k + kFewCandidates; ++step) {
      const float mid = 0.5f * (lo + hi);
      const int64_t f = count_above(x, n, xmax - mid * t);
      if (f >= top_k) {
        hi = mid;
        found = f;
        xi = xmax - hi * t;
      } else {
        lo = mid;
      }
    }
    collect(x, nullptr, n, xi, sc.keys);
    const int64_t take = std::min<int64_t>(top_k, static_cast<int64_t>(sc.keys.size()));
    std::partial_sort(sc.keys.begin(), sc.keys.begin() + take, sc.keys.end());
    double norm = 0.0;
    for (int64_t r = 0; r < take; ++r) {
      const float s = x[index_of(sc.keys[r])] / t;
      if (!(s >= floor)) break;  // dropped by min-p (or -inf): so is everything after it
      const double v = std::exp(static_cast<double>(s - m));
      sc.mass.push_back(v);
      norm += v;
    }
    if (sc.mass.empty()) return index_of(sc.keys[0]);
    return index_of(sc.keys[nucleus_draw(sc.mass, sc.cum, norm, top_p, u, true)]);
  }

  sc.e.resize(n);
  sc.chunk.resize((n + kChunk - 1) / kChunk);
  if (!truncated) {
    const double total = exp_pass<false>(x, n, t, m, floor, sc.e.data(), sc.chunk.data(), nullptr, nullptr);
    const int64_t token = draw_in_order(sc.e.data(), sc.chunk.data(), n, u * total);
    return token >= 0 ? token : 0;
  }

  // Top-p alone: the fewest tokens x >= xi holding at least p of the mass. The
  // exp pass gives the mass above a few gaps and the widest gap's tokens; most
  // rows' nuclei fit one of them, the others search further with mass passes.
  GapStats stats;
  for (int j = 0; j < kGaps; ++j) stats.xi[j] = xmax - kGapNats[j] * t;
  const double total = exp_pass<true>(x, n, t, m, floor, sc.e.data(), sc.chunk.data(), &stats, &sc.keys);
  const double need = static_cast<double>(top_p) * total;
  int fit = 0;
  while (fit < kGaps && stats.mass[fit] < need) ++fit;
  float gap = kLastGap * 2.0f;  // xi = xmax - gap * t; beyond kLastGap: every token
  float xi = kNegInf;
  bool collected = false;
  if (fit < kGaps && !stats.overflow) {  // the kept tokens x >= xi[fit] are among the keys
    gap = kGapNats[fit];
    xi = stats.xi[fit];
    sc.keys.erase(std::remove_if(sc.keys.begin(), sc.keys.end(), [&](uint64_t k) { return x[index_of(k)] < xi; }),
                  sc.keys.end());
    collected = true;
  } else {
    float lo = fit < kGaps ? (fit > 0 ? kGapNats[fit - 1] : 0.0f) : kGapNats[kGaps - 1];
    float hi = fit < kGaps ? kGapNats[fit] : 2.0f * kGapNats[kGaps - 1];
    int64_t found = 0;
    double mass = mass_above(x, sc.e.data(), n, xmax - hi * t, &found);
    while (mass < need && hi < kLastGap) {
      lo = hi;
      hi *= 2.0f;
      mass = mass_above(x, sc.e.data(), n, xmax - hi * t, &found);
    }
    if (mass >= need) {
      gap = hi;
      xi = xmax - hi * t;
    }
    for (int step = 0; step < 8 && mass >= need && found > kFewCandidates; ++step) {
      const float mid = 0.5f * (lo + hi);
      int64_t f = 0;
      const double got = mass_above(x, sc.e.data(), n, xmax - mid * t, &f);
      if (got >= need) {
        hi = mid;
        found = f;
        mass = got;
        gap = hi;
        xi = xmax - hi * t;
      } else {
        lo = mid;
      }
    }
  }
  for (;;) {
    if (!collected) {
      sc.keys.clear();
      collect(x, sc.e.data(), n, xi, sc.keys);
    }
    collected = false;
    std::sort(sc.keys.begin(), sc.keys.end());
    sc.mass.clear();
    for (const uint64_t k : sc.keys) sc.mass.push_back(sc.e[index_of(k)]);
    if (sc.keys.empty()) {  // only when the row's kept mass rounds to nothing
      const int64_t token = draw_in_order(sc.e.data(), sc.chunk.data(), n, u * total);
      return token >= 0 ? token : 0;
    }
    const int64_t pick = nucleus_draw(sc.mass, sc.cum, total, top_p, u, xi == kNegInf);
    if (pick >= 0) return index_of(sc.keys[pick]);
    // The candidates fell short of p by rounding: widen the gap (at last, every token).
    gap = 2.0f * gap + 1.0f;
    xi = gap > kLastGap ? kNegInf : xmax - gap * t;
  }
}

}  // namespace

void sample_tokens(at::Tensor out, at::Tensor logits, at::Tensor rows, at::Tensor temperature, at::Tensor min_p,
                   at::Tensor top_k, at::Tensor top_p, at::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_tokens: logits must be 2-D float32 with contiguous rows");
  const int64_t r = rows.numel();
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab <= std::numeric_limits<int32_t>::max(), "sample_tokens: bad vocabulary size ", vocab);
  auto check = [r](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.numel() == r && t.scalar_type() == dtype && t.is_contiguous(), "sample_tokens: ",
                name, " must be a contiguous [", r, "] ", dtype, " tensor");
  };
  check(out, at::kLong, "out");
  check(rows, at::kLong, "rows");
  check(temperature, at::kFloat, "temperature");
  check(min_p, at::kDouble, "min_p");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kFloat, "top_p");
  check(uniforms, at::kFloat, "uniforms");
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* temp = temperature.data_ptr<float>();
  const double* mp = min_p.data_ptr<double>();
  for (int64_t i = 0; i < r; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "sample_tokens: row ", row[i], " outside the logits");
    TORCH_CHECK(temp[i] > 0.0f && std::isfinite(temp[i]), "sample_tokens: temperature must be finite and > 0");
    TORCH_CHECK(mp[i] >= 0.0 && mp[i] <= 1.0, "sample_tokens: min_p must be in [0, 1]");
  }
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const int64_t* k = top_k.data_ptr<int64_t>();
  const float* p = top_p.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* token = out.data_ptr<int64_t>();
  at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const double log_min_p = mp[i] > 0.0 ? std::log(mp[i]) : -std::numeric_limits<double>::infinity();
      token[i] = sample_row(base + row[i] * stride, vocab, temp[i], log_min_p, k[i], p[i], static_cast<double>(u[i]));
    }
  });
}
