// Paged decode attention for the CPU: one query token per sequence over its
// cached context, read block by block through the block table (vLLM's
// PagedAttention, Kwon et al., SOSP 2023), without padding: the work of a
// sequence is proportional to its own context length.
//
// One task = one (sequence, KV head); it computes all `num_heads / num_kv_heads`
// query heads of that KV head (grouped-query attention, Ainslie et al. 2023), in
// chunks of heads whose accumulators fit the registers (up to 4 heads at head_dim
// 64, 2 at 128, 1 at 256): each K/V row is read and converted once per chunk. Scores,
// softmax and the P.V accumulation are float32 whatever the cache dtype; the
// output is rounded once to the query dtype. Tasks are split between torch's
// intra-op threads by equal shares of context tokens (at::parallel_for).
//
// Layouts (docs/CONTRACTS.md): query/out [S, H, D]; key_cache/value_cache
// [num_blocks, KVH, block_size, D]; block_tables [S, max_blocks] int32;
// context_lens [S] int32 (0 = zero output; clamped to max_blocks*block_size).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "scalar.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using inflight_cpu::exp_approx;
using inflight_cpu::load_f;

struct Geometry {
  int64_t num_heads, num_kv_heads, group, block_size, max_blocks;
};

// Where one sequence's pages of one KV head live: page i (tokens
// [i*block_size, (i+1)*block_size)) starts at base + table[i] * stride.
template <typename T>
struct Pages {
  const T* base;
  const int32_t* table;
  int64_t stride, block_size, ctx;
  const T* page(int64_t i) const { return base + table[i] * stride; }
  int64_t rows(int64_t i) const { return std::min(block_size, ctx - i * block_size); }
  int64_t count() const { return (ctx + block_size - 1) / block_size; }
};

#if defined(__AVX512F__)
// 16 floats from 16 elements of the cache dtype.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp_approx on 16 lanes: same polynomial, 2^n applied with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane L of row_sums16(v) = sum of the 16 lanes of v[L]. Four halving steps
// (segment halves 8, 4, 2, 1); each adds the two halves of every segment of a
// pair (x, y), picked by permutex2var with these indices (16+ = from y).
alignas(64) static const int32_t kHalves[4][2][16] = {
    {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
     {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
    {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
     {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
    {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
     {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
    {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
     {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};

inline __m512 combine(__m512 x, __m512 y, int step) {
  return _mm512_add_ps(_mm512_permutex2var_ps(x, _mm512_load_si512(kHalves[step][0]), y),
                       _mm512_permutex2var_ps(x, _mm512_load_si512(kHalves[step][1]), y));
}

inline __m512 row_sums16(__m512* v) {
  for (int step = 0, n = 16; step < 4; ++step, n /= 2)
    for (int i = 0; i < n / 2; ++i) v[i] = combine(v[2 * i], v[2 * i + 1], step);
  return v[0];
}

inline void prefetch_page(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// scores[h * ctx + t] = scale * q_h . k_t for G heads (q already scaled, [G, D]).
template <typename T, int D, int G>
void chunk_scores(const Pages<T>& keys, const float* q, float* scores) {
  constexpr int V = D / 16;
  __m512 qv[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) qv[h][v] = _mm512_loadu_ps(q + h * D + 16 * v);
  const int64_t pages = keys.count(), ctx = keys.ctx;
  for (int64_t i = 0; i < pages; ++i) {
    const T* rows = keys.page(i);
    const int64_t n = keys.rows(i), t0 = i * keys.block_size;
    if (i + 1 < pages) prefetch_page(keys.page(i + 1), keys.block_size * D * sizeof(T));
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {  // 16 tokens converted once, then per head 16 dot products reduced together
      alignas(64) float tile[16 * D];
      for (int r = 0; r < 16; ++r)
        for (int v = 0; v < V; ++v) _mm512_store_ps(tile + r * D + 16 * v, load16(rows + (j + r) * D + 16 * v));
      for (int h = 0; h < G; ++h) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) {
          __m512 a = _mm512_mul_ps(qv[h][0], _mm512_load_ps(tile + r * D));
          for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[h][v], _mm512_load_ps(tile + r * D + 16 * v), a);
          acc[r] = a;
        }
        _mm512_storeu_ps(scores + h * ctx + t0 + j, row_sums16(acc));
      }
    }
    for (; j < n; ++j) {
      __m512 k[V];
      for (int v = 0; v < V; ++v) k[v] = load16(rows + j * D + 16 * v);
      for (int h = 0; h < G; ++h) {
        __m512 a = _mm512_mul_ps(qv[h][0], k[0]);
        for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[h][v], k[v], a);
        scores[h * ctx + t0 + j] = _mm512_reduce_add_ps(a);
      }
    }
  }
}

// out_h = sum_t p_h[t] v_t for G heads, accumulators in registers; inv_sum[h] normalises.
template <typename T, int D, int G>
void chunk_values(const Pages<T>& values, const float* probs, const float* inv_sum, float* out) {
  constexpr int V = D / 16;
  __m512 acc[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) acc[h][v] = _mm512_setzero_ps();
  const int64_t pages = values.count(), ctx = values.ctx;
  for (int64_t i = 0; i < pages; ++i) {
    const T* rows = values.page(i);
    const int64_t n = values.rows(i), t0 = i * values.block_size;
    if (i + 1 < pages) prefetch_page(values.page(i + 1), values.block_size * D * sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      __m512 val[V];
      for (int v = 0; v < V; ++v) val[v] = load16(rows + j * D + 16 * v);
      for (int h = 0; h < G; ++h) {
        const __m512 p = _mm512_set1_ps(probs[h * ctx + t0 + j]);
        for (int v = 0; v < V; ++v) acc[h][v] = _mm512_fmadd_ps(p, val[v], acc[h][v]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(out + h * D + 16 * v, _mm512_mul_ps(acc[h][v], _mm512_set1_ps(inv_sum[h])));
}

// In place s[t] = exp(s[t] - max s); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float mx = _mm512_reduce_max_ps(m);
  for (int64_t i = t; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}

// Heads per chunk: the chunk's accumulators (G * D / 16 registers) stay in the 32 zmm registers.
template <int D>
constexpr int kMaxChunk = (16 / (D / 16)) < 8 ? (16 / (D / 16) > 0 ? 16 / (D / 16) : 1) : 8;
#else
template <typename T, int D, int G>
void chunk_scores(const Pages<T>& keys, const float* q, float* scores) {
  for (int64_t t = 0; t < keys.ctx; ++t) {
    const T* row = keys.page(t / keys.block_size) + (t % keys.block_size) * D;
    for (int h = 0; h < G; ++h) {
      float s = 0.0f;
      for (int d = 0; d < D; ++d) s += q[h * D + d] * load_f(row[d]);
      scores[h * keys.ctx + t] = s;
    }
  }
}

template <typename T, int D, int G>
void chunk_values(const Pages<T>& values, const float* probs, const float* inv_sum, float* out) {
  std::fill(out, out + G * D, 0.0f);
  for (int64_t t = 0; t < values.ctx; ++t) {
    const T* row = values.page(t / values.block_size) + (t % values.block_size) * D;
    for (int h = 0; h < G; ++h)
      for (int d = 0; d < D; ++d) out[h * D + d] += probs[h * values.ctx + t] * load_f(row[d]);
  }
  for (int h = 0; h < G; ++h)
    for (int d = 0; d < D; ++d) out[h * D + d] *= inv_sum[h];
}

inline float softmax_numerators(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}

template <int D>
constexpr int kMaxChunk = 8;
#endif

// Heads [h0, h0 + G) of one (sequence, KV head): scores, softmax, P.V.
template <typename T, int D, int G>
void attend_chunk(const Pages<T>& keys, const Pages<T>& values, const float* q, float* scores, float* out) {
  chunk_scores<T, D, G>(keys, q, scores);
  float inv_sum[G];
  for (int h = 0; h < G; ++h) inv_sum[h] = 1.0f / softmax_numerators(scores + h * keys.ctx, keys.ctx);
  chunk_values<T, D, G>(values, scores, inv_sum, out);
}

template <typename T, int D, int G = 1>
void attend_heads(int64_t heads, const Pages<T>& keys, const Pages<T>& values, const float* q, float* scores,
                  float* out) {
  if constexpr (G < kMaxChunk<D>) {
    if (heads > G) return attend_heads<T, D, G + 1>(heads, keys, values, q, scores, out);
  }
  for (int64_t h0 = 0; h0 < heads; h0 += G) {
    const int64_t n = std::min<int64_t>(G, heads - h0);
    if (n == G) {
      attend_chunk<T, D, G>(keys, values, q + h0 * D, scores, out + h0 * D);
    } else {
      attend_heads<T, D, 1>(n, keys, values, q + h0 * D, scores, out + h0 * D);
    }
  }
}


// Attention of query heads [kvh*group, (kvh+1)*group) of sequence s.
// scratch: >= group * (ctx + 2 * D) floats.
// Attention of query heads [kvh*group, (kvh+1)*group) of sequence s.
// scratch: >= group * (ctx + 2 * D) floats.
template <typename T, int D>
void attend_one(const T* query, const T* key_cache, const T* value_cache, const int32_t* table, int64_t ctx,
                int64_t kvh, float scale, const Geometry& g, T* out, float* scratch) {
  const int64_t group = g.group;
  float* q = scratch;                  // [group, D], scaled
  float* acc = q + group * D;          // [group, D]
  float* scores = acc + group * D;     // [chunk, ctx]
  T* out_rows = out + kvh * group * D;
  if (ctx <= 0) {
    for (int64_t i = 0; i < group * D; ++i) out_rows[i] = T(0.0f);
    return;
  }
  const T* q_rows = query + kvh * group * D;
  for (int64_t i = 0; i < group * D; ++i) q[i] = load_f(q_rows[i]) * scale;
  const int64_t page = g.block_size * D, stride = g.num_kv_heads * page;
  const Pages<T> keys{key_cache + kvh * page, table, stride, g.block_size, ctx};
  const Pages<T> values{value_cache + kvh * page, table, stride, g.block_size, ctx};
  attend_heads<T, D>(group, keys, values, q, scores, acc);
  for (int64_t i = 0; i < group * D; ++i) out_rows[i] = T(acc[i]);
}

template <typename T, int D>
void run(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const int64_t num_seqs = query.size(0);
  Geometry g{query.size(1), key_cache.size(1), query.size(1) / key_cache.size(1), key_cache.size(2),
             block_tables.size(1)};
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t num_tasks = num_seqs * g.num_kv_heads;
  std::vector<int64_t> ctx(num_seqs), cum(num_tasks + 1, 0);
  int64_t max_ctx = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    ctx[s] = std::max<int64_t>(0, std::min<int64_t>(lens[s], g.max_blocks * g.block_size));
    max_ctx = std::max(max_ctx, ctx[s]);
  }
  for (int64_t i = 0; i < num_tasks; ++i) cum[i + 1] = cum[i] + ctx[i / g.num_kv_heads] + 1;
  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t s = 0; s < num_seqs; ++s)  // a bad id would read outside the cache: fail loudly instead
    for (int64_t i = 0; i < (ctx[s] + g.block_size - 1) / g.block_size; ++i) {
      const int32_t id = tables[s * g.max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention_decode: block id ", id, " of sequence ", s,
                  " outside the cache of ", num_blocks, " blocks");
    }
  T* o = out.data_ptr<T>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  const int64_t scratch_floats = g.group * max_ctx + 2 * g.group * D;
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t part = first; part < last; ++part) {
      // tasks whose cumulative work starts in this thread's equal share
      const int64_t lo = std::lower_bound(cum.begin(), cum.end(), cum[num_tasks] * part / threads) - cum.begin();
      const int64_t hi = std::lower_bound(cum.begin(), cum.end(), cum[num_tasks] * (part + 1) / threads) - cum.begin();
      for (int64_t task = lo; task < std::min(hi, num_tasks); ++task) {
        const int64_t s = task / g.num_kv_heads, kvh = task % g.num_kv_heads;
        attend_one<T, D>(q + s * g.num_heads * D, kc, vc, tables + s * g.max_blocks, ctx[s], kvh,
                         static_cast<float>(scale), g, o + s * g.num_heads * D, scratch.data());
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(int64_t d, const at::Tensor& out, const at::Tensor& query, const at::Tensor& kc,
                       const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& cl, double scale) {
  switch (d) {
    case 32: return run<T, 32>(out, query, kc, vc, bt, cl, scale);
    case 64: return run<T, 64>(out, query, kc, vc, bt, cl, scale);
    case 96: return run<T, 96>(out, query, kc, vc, bt, cl, scale);
    case 128: return run<T, 128>(out, query, kc, vc, bt, cl, scale);
    case 256: return run<T, 256>(out, query, kc, vc, bt, cl, scale);
    default: TORCH_CHECK(false, "paged_attention_decode: unsupported head_dim ", d);
  }
}

}  // namespace

void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention_decode: bad query/cache shapes");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention_decode: query, out and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_attention_decode: block_tables and context_lens must be int32");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_attention_decode: tensors must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_attention_decode: out must be shaped like query");
  TORCH_CHECK(key_cache.size(1) > 0 && query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(1) == 0 &&
                  query.size(1) / key_cache.size(1) <= 64,
              "paged_attention_decode: head_dim mismatch or bad GQA group");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                  context_lens.numel() == query.size(0),
              "paged_attention_decode: block_tables/context_lens do not match the batch");
  const int64_t d = query.size(2);
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch_head_dim<float>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale);
    case at::kBFloat16: return dispatch_head_dim<c10::BFloat16>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale);
    case at::kHalf: return dispatch_head_dim<c10::Half>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale);
    default: TORCH_CHECK(false, "paged_attention_decode: unsupported dtype ", query.scalar_type());
  }
}


// Declared here, defined in layer_ops.cpp (one module, two translation units).
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm(at::Tensor residual, at::Tensor delta, at::Tensor out, at::Tensor weight, double eps);
void rope_qk(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim);
void silu_mul(at::Tensor out, at::Tensor gate_up);
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode, "Paged decode attention (CPU)");
#if defined(__AVX512F__)
  m.attr("has_avx512") = true;
#else
  m.attr("has_avx512") = false;
#endif
  m.def("rms_norm", &rms_norm, "RMSNorm, HF numerics");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta, then RMSNorm");
  m.def("rope_qk", &rope_qk, "rotary embedding in place on fused qkv rows");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("reshape_and_cache", &reshape_and_cache, "write K/V into the paged cache");
}
