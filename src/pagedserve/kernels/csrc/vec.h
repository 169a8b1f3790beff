// Small AVX2 helpers shared by the kernels; exp_lanes at either width (tile_vectors.h).
#pragma once

#include <immintrin.h>

#include <cmath>

#include "tile_vectors.h"

namespace pagedserve {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Below this e^x is a denormal or zero; masked attention scores (-inf) land here too.
constexpr float kExpMin = -87.0f;

// e^x per lane: 2^n * p(r) with r = x - n ln2 and Cephes' degree-6 expf polynomial (~1 ulp).
// Lanes below kExpMin give exactly 0 (softmax over masked keys; SiLU of large negatives).
template <class L>  // quant::V8 or quant::V16
[[gnu::always_inline]] inline typename L::F exp_lanes(typename L::F x0) {
  const typename L::F x = L::min(L::max(x0, L::set1(kExpMin)), L::set1(88.0f));
  const typename L::F n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  typename L::F r = L::fnmadd(n, L::set1(0.693359375f), x);
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  typename L::F y = L::set1(1.9875691500e-4f);
  y = L::fmadd(y, r, L::set1(1.3981999507e-3f));
  y = L::fmadd(y, r, L::set1(8.3334519073e-3f));
  y = L::fmadd(y, r, L::set1(4.1665795894e-2f));
  y = L::fmadd(y, r, L::set1(1.6666665459e-1f));
  y = L::fmadd(y, r, L::set1(5.0000001201e-1f));
  y = L::fmadd(y, L::mul(r, r), L::add(r, L::set1(1.0f)));
  return L::keep_at_least(L::mul(y, L::pow2(n)), x0, kExpMin);
}

inline __m256 exp256(__m256 x) { return exp_lanes<quant::V8>(x); }

}  // namespace pagedserve
