// AVX-512 access to quant_linear.h's packed tiles, shared by the VNNI int8 op and the
// AVX-512 fp32 one: both take four tiles at a time as two zmm of 16 columns.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagedserve::quant {

// Two tiles' 32-byte vectors side by side in one register.
__attribute__((target("avx512f"))) inline __m512i pair512(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// Two tiles' 8 fp16 scales (or mins) as 16 fp32 lanes.
__attribute__((target("avx512f"))) inline __m512 halves512(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))));
}

// One output row's 32 columns (y0: the first 16), plus the bias where there is one.
__attribute__((target("avx512f"))) inline void store_row512(float* out, __m512 y0, __m512 y1, const float* bias) {
  if (bias != nullptr) {
    y0 = _mm512_add_ps(y0, _mm512_loadu_ps(bias));
    y1 = _mm512_add_ps(y1, _mm512_loadu_ps(bias + 16));
  }
  _mm512_storeu_ps(out, y0);
  _mm512_storeu_ps(out + 16, y1);
}

}  // namespace pagedserve::quant
