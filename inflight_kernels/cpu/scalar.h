// Scalar helpers shared by the CPU kernels: storage dtype -> float, and exp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace inflight_cpu {

inline float load_f(float x) { return x; }
inline float load_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load_f(c10::Half x) { return static_cast<float>(x); }

// exp(x) for |x| <= 87 (clamped): 2^n * e^f with n the nearest integer to
// x*log2(e) and e^f, |f| <= ln2/2, from its degree-7 Taylor polynomial
// (relative error < 4e-9 before float rounding). exp(-87) ~ 1.6e-38 is 0 next
// to a softmax row's maximum exp(0) = 1.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 87.0f ? 87.0f : x);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const float f = (t - n) * 0.69314718055994531f;     // in [-0.347, 0.347]
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace inflight_cpu
