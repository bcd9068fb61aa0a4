// exp on the lanes of a `Simd` vector (simd_avx512.h or simd_avx2.h), shared by
// the attention softmax (attention_simd.h) and SiLU (layer_ops.cpp). Included
// inside the includer's namespace, after Simd.
#pragma once

// exp_approx (scalar.h) on W lanes: the same clamp, range reduction and degree-7 polynomial.
template <typename S>
inline typename S::R vexp(typename S::R x) {
  x = S::min(S::max(x, S::set1(-87.0f)), S::set1(87.0f));
  const typename S::R t = S::mul(x, S::set1(1.44269504088896341f));
  const typename S::R n = S::round(t);
  const typename S::R f = S::mul(S::sub(t, n), S::set1(0.69314718055994531f));  // |f| <= ln2 / 2
  typename S::R p = S::set1(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = S::fmadd(p, f, S::set1(c));
  return S::ldexp(p, n);
}
