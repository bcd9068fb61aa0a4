// reshape_and_cache: scatter new K/V rows into the paged KV cache.
//
// key/value   [num_tokens, num_kv_heads, HEAD_SIZE]              (T, contiguous)
// key_cache   [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_SIZE]  (T, contiguous)
// slot_mapping[num_tokens] int64; slot = block_id * BLOCK_SIZE + offset; < 0 = padding.
//
// Grid: one thread block per token (grid.x = num_tokens); threads stride over
// the 16-byte vectors of that token's num_kv_heads * HEAD_SIZE elements, so
// each head's row is read and written with coalesced 16-byte accesses.
#include "dtypes.cuh"

namespace inflight {

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const long long* __restrict__ slot_mapping,
                                         int num_kv_heads) {
  static_assert((HEAD_SIZE * sizeof(T)) % 16 == 0, "a head row must be whole 16-byte vectors");
  constexpr int VEC = 16 / sizeof(T);          // elements per 16-byte vector
  constexpr int ROW_VECS = HEAD_SIZE / VEC;    // vectors per head row
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long block = slot / BLOCK_SIZE;
  const int offset = static_cast<int>(slot % BLOCK_SIZE);
  const uint4* k_src = reinterpret_cast<const uint4*>(key + token * num_kv_heads * HEAD_SIZE);
  const uint4* v_src = reinterpret_cast<const uint4*>(value + token * num_kv_heads * HEAD_SIZE);
  const int n_vecs = num_kv_heads * ROW_VECS;
  for (int i = threadIdx.x; i < n_vecs; i += blockDim.x) {
    const int head = i / ROW_VECS;
    const long long dst_row = (block * num_kv_heads + head) * BLOCK_SIZE + offset;
    const long long dst = dst_row * ROW_VECS + (i % ROW_VECS);
    reinterpret_cast<uint4*>(key_cache)[dst] = k_src[i];
    reinterpret_cast<uint4*>(value_cache)[dst] = v_src[i];
  }
}

}  // namespace inflight

#ifdef INFLIGHT_INSTANTIATE_ALL
// Offline compile check (tests/kernels/test_nvcc_compile.py): every configuration
// in one translation unit. At run time CuPy instantiates one via name expressions.
#define INFLIGHT_RC(T, H, B)                                                              \
  template __global__ void inflight::reshape_and_cache_kernel<T, H, B>(                  \
      const T*, const T*, T*, T*, const long long*, int);
#define INFLIGHT_RC_BS(T, H) INFLIGHT_RC(T, H, 8) INFLIGHT_RC(T, H, 16) INFLIGHT_RC(T, H, 32)
#define INFLIGHT_RC_HS(T) \
  INFLIGHT_RC_BS(T, 64) INFLIGHT_RC_BS(T, 96) INFLIGHT_RC_BS(T, 128) INFLIGHT_RC_BS(T, 256)
INFLIGHT_RC_HS(float)
INFLIGHT_RC_HS(inflight::f16_t)
INFLIGHT_RC_HS(inflight::bf16_t)
#endif
