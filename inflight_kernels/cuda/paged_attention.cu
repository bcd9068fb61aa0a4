// Paged-attention decode: one query token per sequence over a paged KV cache.
//
// Algorithm: vLLM paged attention (Kwon et al., SOSP'23) for the paged layout,
// Flash-Decoding (Dao et al., 2023) for the split-context variant, and the
// online softmax (Milakov & Gimelshein, 2018) inside each thread block.
//
// query        [num_seqs, num_heads, HEAD_SIZE]                   T
// key/value    [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_SIZE]  T
// block_tables [num_seqs, max_blocks_per_seq] int32; context_lens [num_seqs] int32
// out          [num_seqs, num_heads, HEAD_SIZE]                   T
//
// Grid (num_kv_heads, num_seqs, num_partitions), NUM_THREADS threads. One thread
// block owns the gqa = num_heads / num_kv_heads query heads that share a KV
// head, so each K/V page is read from global memory once per KV head. A block
// walks its token range in tiles of TILE tokens: stage K and V (16-byte loads)
// in shared memory, score all gqa heads, update the running max/sum, rescale
// and accumulate P.V in fp32. With one partition it writes `out`; with several
// it writes per-partition max logit, exp-sum and unnormalized fp32 output, and
// paged_attention_reduce_kernel combines them.
#include "dtypes.cuh"

namespace inflight {

constexpr int TILE = 32;          // tokens per tile (= warp size: one lane per token)
constexpr int NUM_THREADS = 128;  // inflight_kernels/launch.py relies on both values
constexpr int NUM_WARPS = NUM_THREADS / 32;

struct SmemLayout {  // dynamic shared memory carve-up; mirrored in launch.py
  unsigned char* k;  // TILE * HEAD_SIZE elements of T
  unsigned char* v;  // TILE * HEAD_SIZE elements of T
  float* q;          // gqa * HEAD_SIZE, pre-scaled query
  float* acc;        // gqa * HEAD_SIZE, unnormalized output
  float* s;          // gqa * TILE, scores then probabilities
  float* m;          // gqa running max
  float* l;          // gqa running sum
  float* alpha;      // gqa rescale factor of the current tile
};

template <typename T, int HEAD_SIZE>
__device__ __forceinline__ SmemLayout carve_smem(unsigned char* base, int gqa) {
  constexpr int KV_BYTES = TILE * HEAD_SIZE * static_cast<int>(sizeof(T));
  SmemLayout L;
  L.k = base;
  L.v = base + KV_BYTES;
  L.q = reinterpret_cast<float*>(base + 2 * KV_BYTES);
  L.acc = L.q + gqa * HEAD_SIZE;
  L.s = L.acc + gqa * HEAD_SIZE;
  L.m = L.s + gqa * TILE;
  L.l = L.m + gqa;
  L.alpha = L.l + gqa;
  return L;
}

// Stage the K and V pages of tokens [tile_start, tile_start + TILE) that begin before `end`.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ void load_tile(const SmemLayout& L, const T* key_cache, const T* value_cache,
                          const int* block_table, int kv_head, int num_kv_heads,
                          int tile_start, int end) {
  constexpr int BLOCK_VECS = BLOCK_SIZE * HEAD_SIZE * static_cast<int>(sizeof(T)) / 16;
  constexpr int TILE_BLOCKS = TILE / BLOCK_SIZE;
  for (int i = threadIdx.x; i < TILE_BLOCKS * BLOCK_VECS; i += NUM_THREADS) {
    const int b = i / BLOCK_VECS;
    const int token0 = tile_start + b * BLOCK_SIZE;
    if (token0 >= end) continue;
    const long long page = static_cast<long long>(block_table[token0 / BLOCK_SIZE]) * num_kv_heads + kv_head;
    const long long src = page * BLOCK_VECS + (i - b * BLOCK_VECS);
    reinterpret_cast<uint4*>(L.k)[i] = reinterpret_cast<const uint4*>(key_cache)[src];
    reinterpret_cast<uint4*>(L.v)[i] = reinterpret_cast<const uint4*>(value_cache)[src];
  }
}

// Scores s[g][t] = q_g . k_t for every head of the group; one warp per token.
template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void score_tile(const SmemLayout& L, int gqa, int n_valid) {
  constexpr int PER_LANE = HEAD_SIZE / 32;
  const int lane = threadIdx.x & 31;
  const T* k = reinterpret_cast<const T*>(L.k);
  for (int t = threadIdx.x >> 5; t < TILE; t += NUM_WARPS) {
    float kr[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) kr[j] = to_float(k[t * HEAD_SIZE + lane + 32 * j]);
    for (int g = 0; g < gqa; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < PER_LANE; ++j) dot += L.q[g * HEAD_SIZE + lane + 32 * j] * kr[j];
      dot = warp_sum(dot);
      if (lane == 0) L.s[g * TILE + t] = t < n_valid ? dot : neg_inf();
    }
  }
}

// Online softmax update per head: one warp per head, one lane per token.
__device__ __forceinline__ void softmax_tile(const SmemLayout& L, int gqa, int n_valid) {
  const int lane = threadIdx.x & 31;
  for (int g = threadIdx.x >> 5; g < gqa; g += NUM_WARPS) {
    const float x = L.s[g * TILE + lane];
    const float m_old = L.m[g];
    const float m_new = fmaxf(m_old, warp_max(x));  // finite: n_valid >= 1
    const float p = lane < n_valid ? expf(x - m_new) : 0.f;
    const float tile_sum = warp_sum(p);
    L.s[g * TILE + lane] = p;
    if (lane == 0) {
      const float alpha = expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
      L.alpha[g] = alpha;
      L.l[g] = L.l[g] * alpha + tile_sum;
      L.m[g] = m_new;
    }
  }
}

// acc[g][d] = alpha[g] * acc[g][d] + sum_t p[g][t] * v[t][d]; each thread owns fixed (g, d).
template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void accumulate_tile(const SmemLayout& L, int gqa, int n_valid) {
  const T* v = reinterpret_cast<const T*>(L.v);
  for (int idx = threadIdx.x; idx < gqa * HEAD_SIZE; idx += NUM_THREADS) {
    const int g = idx / HEAD_SIZE;
    const int d = idx - g * HEAD_SIZE;
    float a = L.acc[idx] * L.alpha[g];
#pragma unroll 8
    for (int t = 0; t < n_valid; ++t) a += L.s[g * TILE + t] * to_float(v[t * HEAD_SIZE + d]);
    L.acc[idx] = a;
  }
}

template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void init_group(const SmemLayout& L, const T* q, float scale, int gqa) {
  for (int idx = threadIdx.x; idx < gqa * HEAD_SIZE; idx += NUM_THREADS) {
    L.q[idx] = to_float(q[idx]) * scale;
    L.acc[idx] = 0.f;
  }
  for (int g = threadIdx.x; g < gqa; g += NUM_THREADS) {
    L.m[g] = neg_inf();
    L.l[g] = 0.f;
  }
}

// Single pass: normalized output. Split: unnormalized fp32 partials + max/sum.
template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void store_group(const SmemLayout& L, T* out, float* exp_sums, float* max_logits,
                            float* tmp_out, long long head0, int gqa) {
  const int num_partitions = gridDim.z;
  for (int idx = threadIdx.x; idx < gqa * HEAD_SIZE; idx += NUM_THREADS) {
    const int g = idx / HEAD_SIZE;
    const int d = idx - g * HEAD_SIZE;
    const long long row = (head0 + g) * num_partitions + blockIdx.z;
    if (num_partitions == 1) {
      const float l = L.l[g];
      out[(head0 + g) * HEAD_SIZE + d] = from_float<T>(l > 0.f ? L.acc[idx] / l : 0.f);
    } else {
      tmp_out[row * HEAD_SIZE + d] = L.acc[idx];
    }
  }
  if (num_partitions > 1) {
    for (int g = threadIdx.x; g < gqa; g += NUM_THREADS) {
      const long long row = (head0 + g) * num_partitions + blockIdx.z;
      max_logits[row] = L.m[g];
      exp_sums[row] = L.l[g];
    }
  }
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(NUM_THREADS)
paged_attention_kernel(T* __restrict__ out, float* __restrict__ exp_sums,
                       float* __restrict__ max_logits, float* __restrict__ tmp_out,
                       const T* __restrict__ query, const T* __restrict__ key_cache,
                       const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                       const int* __restrict__ context_lens, float scale, int gqa,
                       int max_blocks_per_seq, int partition_size) {
  static_assert(HEAD_SIZE % 32 == 0, "HEAD_SIZE must be a multiple of 32");
  static_assert(TILE % BLOCK_SIZE == 0, "BLOCK_SIZE must divide TILE");
  extern __shared__ uint4 smem_raw[];
  const SmemLayout L = carve_smem<T, HEAD_SIZE>(reinterpret_cast<unsigned char*>(smem_raw), gqa);
  const int kv_head = blockIdx.x, num_kv_heads = gridDim.x, seq = blockIdx.y;
  const int ctx = min(context_lens[seq], max_blocks_per_seq * BLOCK_SIZE);
  const int start = blockIdx.z * partition_size;
  const int end = min(start + partition_size, ctx);
  const long long head0 = static_cast<long long>(seq) * num_kv_heads * gqa + kv_head * gqa;
  if (start >= end && gridDim.z > 1) return;  // empty partition: the reduction skips it
  init_group<T, HEAD_SIZE>(L, query + head0 * HEAD_SIZE, scale, gqa);
  const int* block_table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  for (int tile_start = start; tile_start < end; tile_start += TILE) {
    const int n_valid = min(TILE, end - tile_start);
    __syncthreads();  // previous tile fully consumed (and init done)
    load_tile<T, HEAD_SIZE, BLOCK_SIZE>(L, key_cache, value_cache, block_table, kv_head,
                                        num_kv_heads, tile_start, end);
    __syncthreads();
    score_tile<T, HEAD_SIZE>(L, gqa, n_valid);
    __syncthreads();
    softmax_tile(L, gqa, n_valid);
    __syncthreads();
    accumulate_tile<T, HEAD_SIZE>(L, gqa, n_valid);
  }
  __syncthreads();
  store_group<T, HEAD_SIZE>(L, out, exp_sums, max_logits, tmp_out, head0, gqa);
}

// Combine the partitions of one (sequence, head): grid (num_heads, num_seqs).
// Dynamic shared memory: (num_partitions + 1) floats.
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(NUM_THREADS)
paged_attention_reduce_kernel(T* __restrict__ out, const float* __restrict__ exp_sums,
                              const float* __restrict__ max_logits,
                              const float* __restrict__ tmp_out,
                              const int* __restrict__ context_lens, int num_partitions,
                              int partition_size, int max_context) {
  extern __shared__ float weights[];  // [num_partitions] then the total
  const long long row = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int ctx = min(context_lens[blockIdx.y], max_context);
  const int n = min(num_partitions, (ctx + partition_size - 1) / partition_size);
  const float* ms = max_logits + row * num_partitions;
  const float* ls = exp_sums + row * num_partitions;
  if (threadIdx.x < 32) {
    float m = neg_inf();
    for (int p = threadIdx.x; p < n; p += 32) m = fmaxf(m, ms[p]);
    m = warp_max(m);
    float total = 0.f;
    for (int p = threadIdx.x; p < n; p += 32) {
      const float w = expf(ms[p] - m);
      weights[p] = w;
      total += w * ls[p];
    }
    total = warp_sum(total);
    if (threadIdx.x == 0) weights[num_partitions] = total;
  }
  __syncthreads();
  const float total = weights[num_partitions];
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const float* partial = tmp_out + row * num_partitions * HEAD_SIZE;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float a = 0.f;
    for (int p = 0; p < n; ++p) a += weights[p] * partial[p * HEAD_SIZE + d];
    out[row * HEAD_SIZE + d] = from_float<T>(a * inv);
  }
}

}  // namespace inflight

#ifdef INFLIGHT_INSTANTIATE_ALL
// Offline compile check (tests/kernels/test_nvcc_compile.py): every configuration
// in one translation unit. At run time CuPy instantiates one via name expressions.
#define INFLIGHT_PA(T, H, B)                                                              \
  template __global__ void inflight::paged_attention_kernel<T, H, B>(                    \
      T*, float*, float*, float*, const T*, const T*, const T*, const int*, const int*,   \
      float, int, int, int);
#define INFLIGHT_PR(T, H)                                                                 \
  template __global__ void inflight::paged_attention_reduce_kernel<T, H>(                \
      T*, const float*, const float*, const float*, const int*, int, int, int);
#define INFLIGHT_PA_BS(T, H) \
  INFLIGHT_PA(T, H, 8) INFLIGHT_PA(T, H, 16) INFLIGHT_PA(T, H, 32) INFLIGHT_PR(T, H)
#define INFLIGHT_PA_HS(T) \
  INFLIGHT_PA_BS(T, 64) INFLIGHT_PA_BS(T, 96) INFLIGHT_PA_BS(T, 128) INFLIGHT_PA_BS(T, 256)
INFLIGHT_PA_HS(float)
INFLIGHT_PA_HS(inflight::f16_t)
INFLIGHT_PA_HS(inflight::bf16_t)
#endif
