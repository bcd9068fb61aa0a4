// Paged decode attention for the CPU: one query token per sequence over its
// cached context, read block by block through the block table (vLLM's
// PagedAttention, Kwon et al., SOSP 2023), without padding: the work of a
// sequence is proportional to its own context length.
//
// One task = one sequence's KV heads: all of them when there are at least
// kSeqsPerThread sequences per thread, else one (so a single sequence still splits
// between the threads). For each KV head it computes all `num_heads / num_kv_heads`
// query heads (grouped-query attention, Ainslie et al. 2023), in chunks of heads whose
// accumulators fit the registers (up to 4 heads at head_dim 64, 2 at 128, 1 at 256):
// each K/V row is read and converted once per chunk. A task of several KV heads walks
// its pages page-major (page i of every KV head, then page i + 1): a block's KV heads
// lie together ([KVH, block_size, D]), so the walk reads each block as one run, and the
// next block is prefetched head by head while this one is used: faster than one KV
// head per task on an AMD EPYC Zen 5 (bench/RESULTS.md run 33). Scores,
// softmax and the P.V accumulation are float32 whatever the cache dtype; the
// output is rounded once to the query dtype. The query (and output) dtype is the
// cache's, or float32 over a bfloat16/float16 cache (float32 compute with a
// half-size cache: q is not rounded, nor is the output). Tasks are split between torch's
// intra-op threads by equal shares of context tokens (at::parallel_for).
//
// Layouts (docs/CONTRACTS.md): query/out [S, H, D]; key_cache/value_cache
// [num_blocks, KVH, block_size, D]; block_tables [S, max_blocks] int32;
// context_lens [S] int32 (0 = zero output; clamped to max_blocks*block_size).
//
// A sliding window (window > 0: the query at position ctx - 1 sees keys
// [max(0, ctx - window), ctx), HF's kv_idx > q_idx - window) starts the walk at
// the window's first page: pages wholly before it are neither read nor checked,
// and the first `skip` keys of that page get probability 0. A soft-cap
// (softcap > 0, Gemma 2) maps each scaled score x to softcap * tanh(x / softcap)
// before the softmax.

#include "aten_headers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "scalar.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using inflight_cpu::exp_approx;
using inflight_cpu::load_f;

// Sequences per thread from which a task takes all of a sequence's KV heads (see run).
constexpr int64_t kSeqsPerThread = 2;

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
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define INFLIGHT_BF16_DOT 1  // chunk_scores_bf16 (attention_simd.h): vdpbf16ps for a bf16 query over a bf16 cache
#endif
#if defined(__AVX512F__)
#include "simd_avx512.h"
#include "attention_simd.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#include "attention_simd.h"
#else
#include "attention_scalar.h"
#endif

// The query heads of one (sequence, KV head): float32, already scaled, and the
// query's own bfloat16 values when both it and the cache are bfloat16 (else null).
// skip: leading keys of the walk outside the sliding window; softcap: 0 = off.
struct Query {
  const float* scaled;              // [heads, D]
  const c10::BFloat16* bf16;        // [heads, D] or nullptr
  float scale;
  int64_t skip;
  float softcap;
  Query from_head(int64_t h0, int64_t d) const {
    return {scaled + h0 * d, bf16 ? bf16 + h0 * d : nullptr, scale, skip, softcap};
  }
};

// Softmax numerators of one head's scores [ctx] in place, the first q.skip set
// to 0 (outside the window), after the optional soft-cap; returns 1 / sum.
inline float softmax_row(float* row, int64_t ctx, const Query& q) {
  if (q.softcap > 0.0f) {
    const float inv = 1.0f / q.softcap;
    for (int64_t t = q.skip; t < ctx; ++t) row[t] = q.softcap * std::tanh(row[t] * inv);
  }
  const float inv_sum = 1.0f / softmax_numerators(row + q.skip, ctx - q.skip);
  std::fill(row, row + q.skip, 0.0f);
  return inv_sum;
}

// Whether the scores and P.V take the vdpbf16ps path: a bfloat16 query over a bfloat16 cache.
template <typename T>
inline bool bf16_dot(const Query& q) {
#if defined(INFLIGHT_BF16_DOT)
  return std::is_same_v<T, c10::BFloat16> && q.bf16 != nullptr;
#else
  return false;
#endif
}

// Scores of n (<= kMaxChunk<D>) heads over pages [p0, p1): chunk_scores<.., n>.
template <typename T, int D, int G = 1>
void scores_chunk(int64_t n, const Pages<T>& keys, int64_t p0, int64_t p1, const Query& q, float* scores) {
  if constexpr (G < kMaxChunk<D>) {
    if (n > G) return scores_chunk<T, D, G + 1>(n, keys, p0, p1, q, scores);
  }
#if defined(INFLIGHT_BF16_DOT)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (q.bf16) return chunk_scores_bf16<D, G>(keys, p0, p1, q.bf16, q.scale, scores);
  }
#endif
  chunk_scores<T, D, G>(keys, p0, p1, q.scaled, scores);
}

// acc += P.V of n (<= kMaxChunk<D>) heads over pages [p0, p1): chunk_values<.., n>.
template <typename T, int D, int G = 1>
void values_chunk(int64_t n, bool bf16, const Pages<T>& values, int64_t p0, int64_t p1, const float* probs, float* acc) {
  if constexpr (G < kMaxChunk<D>) {
    if (n > G) return values_chunk<T, D, G + 1>(n, bf16, values, p0, p1, probs, acc);
  }
#if defined(INFLIGHT_BF16_DOT)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16) return chunk_values_bf16<D, G>(values, p0, p1, probs, acc);
  }
#endif
  chunk_values<T, D, G>(values, p0, p1, probs, acc);
}

// Pages one thread's walks will read, prefetched into L2 (prefetcht1) kLookaheadPages
// pages ahead of the walk, in the walk's own order: each task's keys page by page, then
// its values, then the next task's. The walks' own prefetch of the next page into L1
// starts a page's reads only about one page of arithmetic before they are needed, too
// late to cover DRAM latency with so few reads in flight; this stream keeps
// kLookaheadPages pages of reads going, across the boundary between tasks too. Used
// for page-major tasks (several KV heads), whose walks advance it once per page.
// Faster attention on an AMD EPYC Zen 4, most with the blocks scattered over the
// worker's pool (bench/RESULTS.md run 35).
constexpr int64_t kLookaheadPages = 4;  // 2 to 32 measured alike (run 35)

template <typename T>
struct Lookahead {
  const T* caches[2];  // the walk reads keys (0), then values (1)
  const int32_t* tables;
  const int64_t* first_page;  // per sequence, as in run()
  const int64_t* ctx;         // per sequence, from its first page
  int64_t max_blocks, block_size, stride, tasks_per_seq, kv_per_task, head_elems;  // head_elems: block_size * D
  int64_t end;                // one past the thread's last task
  int64_t task = 0, phase = 0, page = 0;  // the next page to prefetch

  int64_t pages_of(int64_t t) const { return (ctx[t / tasks_per_seq] + block_size - 1) / block_size; }
  void skip_empty() {
    while (task < end && pages_of(task) == 0) ++task;
  }
  void start(int64_t first) {  // the walk begins at task `first`: prefetch its first pages
    task = first, phase = 0, page = 0;
    skip_empty();
    for (int64_t i = 0; i < kLookaheadPages; ++i) advance();
  }
  void advance() {  // prefetch the page at the cursor, then move the cursor one page on
    if (task >= end) return;
    const int64_t s = task / tasks_per_seq, kv0 = task % tasks_per_seq * kv_per_task;
    const int32_t id = tables[s * max_blocks + first_page[s] + page];
    const char* c = reinterpret_cast<const char*>(caches[phase] + id * stride + kv0 * head_elems);
    const int64_t bytes = kv_per_task * head_elems * static_cast<int64_t>(sizeof(T));
    for (int64_t off = 0; off < bytes; off += 64) {
#if defined(__x86_64__) || defined(__i386__)
      __asm__ volatile("prefetcht1 %0" : : "m"(c[off]));  // volatile asm: see prefetch_page
#else
      __builtin_prefetch(c + off, 0, 2);
#endif
    }
    if (++page < pages_of(task)) return;
    page = 0;
    if (++phase < 2) return;
    phase = 0;
    ++task;
    skip_empty();
  }
};

// The KV heads [kv0, kv1) of one sequence, each with its `group` query heads, in
// chunks of up to kMaxChunk<D> heads. The walk is page-major: page i of every KV head
// of the range before page i + 1, so the range's part of a block ([kv1 - kv0,
// block_size, D], contiguous) is read as one run and the next block's is prefetched
// while this one is used.
template <typename T, int D>
struct SeqHeads {
  const T* key_cache;
  const T* value_cache;
  const int32_t* table;
  int64_t ctx, kv0, kv1, group, block_size, stride;  // stride: elements per block of the cache
  Lookahead<T>* lookahead;  // advanced once per page of a page-major walk; or null

  int64_t num_pages() const { return (ctx + block_size - 1) / block_size; }
  Pages<T> pages(const T* cache, int64_t kvh) const {
    return {cache + kvh * block_size * D, table, stride, block_size, ctx};
  }
  void prefetch(const T* cache, int64_t i, int64_t kvh) const {  // KV head kvh's part of page i
    prefetch_page(cache + table[i] * stride + kvh * block_size * D, block_size * D * sizeof(T));
  }
  template <class F>
  void each_chunk(F&& f) const {  // f(kvh, first head of the range, heads in the chunk)
    for (int64_t kvh = kv0; kvh < kv1; ++kvh)
      for (int64_t h0 = 0; h0 < group; h0 += kMaxChunk<D>)
        f(kvh, (kvh - kv0) * group + h0, std::min<int64_t>(kMaxChunk<D>, group - h0));
  }
};

// scores [heads, ctx]: every head's scaled q.k, then its softmax numerators; inv_sum [heads].
template <typename T, int D>
void range_scores(const SeqHeads<T, D>& r, const Query& q, float* scores, float* inv_sum) {
  const int64_t pages = r.num_pages(), heads = (r.kv1 - r.kv0) * r.group;
  const int64_t step = r.kv1 - r.kv0 > 1 ? 1 : pages;  // one KV head: the chunk walks (and prefetches) alone
  for (int64_t i = 0; i < pages; i += step) {
    if (r.lookahead) r.lookahead->advance();
    r.each_chunk([&](int64_t kvh, int64_t head, int64_t n) {
      if (i + step < pages && head % r.group == 0) r.prefetch(r.key_cache, i + step, kvh);
      scores_chunk<T, D>(n, r.pages(r.key_cache, kvh), i, std::min(pages, i + step), q.from_head(head, D),
                         scores + head * r.ctx);
    });
  }
  for (int64_t h = 0; h < heads; ++h) inv_sum[h] = softmax_row(scores + h * r.ctx, r.ctx, q);
}

// acc [heads, D] = the unnormalised P.V of every head (zeroed first).
template <typename T, int D>
void range_values(const SeqHeads<T, D>& r, bool bf16, float* probs, float* acc) {
  const int64_t pages = r.num_pages(), heads = (r.kv1 - r.kv0) * r.group;
  std::fill(acc, acc + heads * D, 0.0f);
#if defined(INFLIGHT_BF16_DOT)
  if (bf16)
    for (int64_t h = 0; h < heads; ++h) probs_to_bf16(probs + h * r.ctx, r.ctx);
#endif
  const int64_t step = r.kv1 - r.kv0 > 1 ? 1 : pages;
  for (int64_t i = 0; i < pages; i += step) {
    if (r.lookahead) r.lookahead->advance();
    r.each_chunk([&](int64_t kvh, int64_t head, int64_t n) {
      if (i + step < pages && head % r.group == 0) r.prefetch(r.value_cache, i + step, kvh);
      values_chunk<T, D>(n, bf16, r.pages(r.value_cache, kvh), i, std::min(pages, i + step), probs + head * r.ctx,
                         acc + head * D);
    });
  }
}

// Attention of query heads [kv0*group, kv1*group) of sequence s; T is the cache's
// element type, Q the query's and output's. table and ctx start at the window's first
// page, whose first `skip` keys are masked. scratch: >= heads * (ctx + 2 * D + 1) floats.
template <typename T, typename Q, int D>
void attend_one(const Q* query, const T* key_cache, const T* value_cache, const int32_t* table, int64_t ctx,
                int64_t skip, float softcap, int64_t kv0, int64_t kv1, float scale, const Geometry& g, Q* out,
                float* scratch, Lookahead<T>* lookahead) {
  const int64_t heads = (kv1 - kv0) * g.group;
  float* q = scratch;                    // [heads, D], scaled
  float* acc = q + heads * D;            // [heads, D]
  float* scores = acc + heads * D;       // [heads, ctx]
  float* inv_sum = scores + heads * ctx; // [heads]
  Q* out_rows = out + kv0 * g.group * D;
  if (ctx <= 0) {
    for (int64_t i = 0; i < heads * D; ++i) out_rows[i] = Q(0.0f);
    return;
  }
  const Q* q_rows = query + kv0 * g.group * D;
  for (int64_t i = 0; i < heads * D; ++i) q[i] = load_f(q_rows[i]) * scale;
  const c10::BFloat16* q_bf16 = nullptr;
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>) q_bf16 = q_rows;
  const Query qs{q, q_bf16, scale, skip, softcap};
  const SeqHeads<T, D> r{key_cache, value_cache, table, ctx, kv0, kv1, g.group, g.block_size,
                         g.num_kv_heads * g.block_size * D, kv1 - kv0 > 1 ? lookahead : nullptr};
  range_scores<T, D>(r, qs, scores, inv_sum);
  const bool bf16 = bf16_dot<T>(qs);
  range_values<T, D>(r, bf16, scores, acc);
  for (int64_t h = 0; h < heads; ++h) {
    float row[D];
#if defined(INFLIGHT_BF16_DOT)
    if (bf16) {
      finish_values_bf16<D>(acc + h * D, inv_sum[h], row);
    } else
#endif
      for (int64_t d = 0; d < D; ++d) row[d] = acc[h * D + d] * inv_sum[h];
    for (int64_t d = 0; d < D; ++d) out_rows[h * D + d] = Q(row[d]);
  }
}

template <typename T, typename Q, int D>
void run(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
         double softcap) {
  const int64_t num_seqs = query.size(0);
  Geometry g{query.size(1), key_cache.size(1), query.size(1) / key_cache.size(1), key_cache.size(2),
             block_tables.size(1)};
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  // A task is one sequence's KV heads [kv0, kv0 + kv_per_task): all of them (the block's KV heads
  // read as one run) when there are sequences enough to keep every thread busy, else one.
  const int64_t threads_max = at::get_num_threads();
  const int64_t kv_per_task = num_seqs >= kSeqsPerThread * threads_max ? g.num_kv_heads : 1;
  const int64_t tasks_per_seq = g.num_kv_heads / kv_per_task, num_tasks = num_seqs * tasks_per_seq;
  // per sequence: the first page read, then keys walked from it and masked at its start
  std::vector<int64_t> ctx(num_seqs), first_page(num_seqs, 0), skip(num_seqs, 0), cum(num_tasks + 1, 0);
  int64_t max_ctx = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = std::max<int64_t>(0, std::min<int64_t>(lens[s], g.max_blocks * g.block_size));
    if (window > 0 && len > window) {
      first_page[s] = (len - window) / g.block_size;
      skip[s] = len - window - first_page[s] * g.block_size;
    }
    ctx[s] = len - first_page[s] * g.block_size;
    max_ctx = std::max(max_ctx, ctx[s]);
  }
  for (int64_t i = 0; i < num_tasks; ++i) cum[i + 1] = cum[i] + ctx[i / tasks_per_seq] + 1;
  const Q* q = query.data_ptr<Q>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t s = 0; s < num_seqs; ++s)  // a bad id would read outside the cache: fail loudly instead
    for (int64_t i = 0; i < (ctx[s] + g.block_size - 1) / g.block_size; ++i) {
      const int32_t id = tables[s * g.max_blocks + first_page[s] + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention_decode: block id ", id, " of sequence ", s,
                  " outside the cache of ", num_blocks, " blocks");
    }
  Q* o = out.data_ptr<Q>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(threads_max, num_tasks));
  const int64_t task_heads = kv_per_task * g.group, scratch_floats = task_heads * (max_ctx + 2 * D + 1);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t part = first; part < last; ++part) {
      // tasks whose cumulative work starts in this thread's equal share
      const int64_t lo = std::lower_bound(cum.begin(), cum.end(), cum[num_tasks] * part / threads) - cum.begin();
      const int64_t hi = std::lower_bound(cum.begin(), cum.end(), cum[num_tasks] * (part + 1) / threads) - cum.begin();
      const int64_t end = std::min(hi, num_tasks);
      Lookahead<T> ahead{{kc, vc}, tables, first_page.data(), ctx.data(), g.max_blocks, g.block_size,
                         g.num_kv_heads * g.block_size * D, tasks_per_seq, kv_per_task, g.block_size * D, end};
      Lookahead<T>* lookahead = kv_per_task > 1 ? &ahead : nullptr;
      if (lookahead) lookahead->start(lo);
      for (int64_t task = lo; task < end; ++task) {
        const int64_t s = task / tasks_per_seq, kv0 = task % tasks_per_seq * kv_per_task;
        attend_one<T, Q, D>(q + s * g.num_heads * D, kc, vc, tables + s * g.max_blocks + first_page[s], ctx[s], skip[s],
                            static_cast<float>(softcap), kv0, kv0 + kv_per_task, static_cast<float>(scale), g,
                            o + s * g.num_heads * D, scratch.data(), lookahead);
      }
    }
  });
}

template <typename T, typename Q = T>
void dispatch_head_dim(int64_t d, const at::Tensor& out, const at::Tensor& query, const at::Tensor& kc,
                       const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& cl, double scale, int64_t w,
                       double cap) {
  switch (d) {
    case 32: return run<T, Q, 32>(out, query, kc, vc, bt, cl, scale, w, cap);
    case 64: return run<T, Q, 64>(out, query, kc, vc, bt, cl, scale, w, cap);
    case 96: return run<T, Q, 96>(out, query, kc, vc, bt, cl, scale, w, cap);
    case 128: return run<T, Q, 128>(out, query, kc, vc, bt, cl, scale, w, cap);
    case 256: return run<T, Q, 256>(out, query, kc, vc, bt, cl, scale, w, cap);
    default: TORCH_CHECK(false, "paged_attention_decode: unsupported head_dim ", d);
  }
}

}  // namespace

void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t window,
                            double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention_decode: bad query/cache shapes");
  const bool float_query = query.scalar_type() == at::kFloat && key_cache.scalar_type() != at::kFloat;
  TORCH_CHECK((query.scalar_type() == key_cache.scalar_type() || float_query) &&
                  out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention_decode: query and out must share the caches' dtype, or be float32");
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
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention_decode: window and softcap must be >= 0");
  const int64_t d = query.size(2);
  if (float_query) {
    if (key_cache.scalar_type() == at::kBFloat16)
      return dispatch_head_dim<c10::BFloat16, float>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap);
    if (key_cache.scalar_type() == at::kHalf)
      return dispatch_head_dim<c10::Half, float>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap);
    TORCH_CHECK(false, "paged_attention_decode: unsupported cache dtype ", key_cache.scalar_type());
  }
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch_head_dim<float>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap);
    case at::kBFloat16: return dispatch_head_dim<c10::BFloat16>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap);
    case at::kHalf: return dispatch_head_dim<c10::Half>(d, out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap);
    default: TORCH_CHECK(false, "paged_attention_decode: unsupported dtype ", query.scalar_type());
  }
}

// Whether this build scores a bfloat16 query over a bfloat16 cache with vdpbf16ps
// (module.cpp exposes it as the module's `bf16_dot`).
bool paged_attention_bf16_dot() {
#if defined(INFLIGHT_BF16_DOT)
  return true;
#else
  return false;
#endif
}
