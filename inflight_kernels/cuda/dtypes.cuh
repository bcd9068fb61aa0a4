// Storage types and conversions shared by the inflight kernels.
//
// Header-free on purpose: the same text compiles under nvcc (tests, sm_80/sm_90)
// and under NVRTC (CuPy RawModule at run time) with no include path to the
// CUDA toolkit. fp16/bf16 are stored as 16-bit patterns and converted to fp32
// for all arithmetic (fp32 accumulation everywhere).
#pragma once

namespace inflight {

struct f16_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(f16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

__device__ __forceinline__ float to_float(bf16_t x) {
  return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float f);

template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }

template <> __device__ __forceinline__ f16_t from_float<f16_t>(float f) {
  f16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}

// Round to nearest even in integer arithmetic (works on every architecture).
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  unsigned int u = __float_as_uint(f);
  bf16_t b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and NaN
    b.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
    return b;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  b.bits = static_cast<unsigned short>(u >> 16);
  return b;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Copy n16 16-byte vectors from global to shared memory, strided over the block.
__device__ __forceinline__ void copy16(uint4* dst, const uint4* src, int n16) {
  for (int i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = src[i];
}

}  // namespace inflight
