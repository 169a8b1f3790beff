// The vectors the native kernels are written over once: V8 is 8 float lanes in a ymm (one
// packed tile's 8 output columns, tile_formats.inc), V16 16 lanes in a zmm (two tiles'
// columns; AVX-512 only). Each op is the same instruction at either width, so code written
// over them has the same per-lane arithmetic, and the same bits, on both paths (vec.h's
// exp_lanes, the attention kernel's values).
#pragma once

#include <immintrin.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "tiles512.h"

namespace pagedserve::quant {

// One tile's 8 columns in a ymm.
struct V8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kTiles = 1;
  static constexpr int64_t kCols = 8;
  static I ld(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F ph(const uint8_t* p, int64_t) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F bf(const uint8_t* p, int64_t) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static I u8i(const uint8_t* p, int64_t) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static F u8(const uint8_t* p, int64_t s) { return _mm256_cvtepi32_ps(u8i(p, s)); }
  static F i8(const uint8_t* p, int64_t) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // table[idx] per lane, idx in 0..15: two 8-entry permutes, bit 3 (moved to the sign) picks.
  static F lookup16(const float* table, I idx) {
    const F lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), idx);
    const F hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
  template <int S> static I srli(I a) { return _mm256_srli_epi32(a, S); }
  template <int S> static I slli(I a) { return _mm256_slli_epi32(a, S); }
  template <int S> static I srai(I a) { return _mm256_srai_epi32(a, S); }
  template <int S> static I srli16(I a) { return _mm256_srli_epi16(a, S); }
  template <int S> static I slli16(I a) { return _mm256_slli_epi16(a, S); }
  static I set8(char v) { return _mm256_set1_epi8(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I seti(int v) { return _mm256_set1_epi32(v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F neg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for whole n in [-127, 128].
  static F pow2(F n) { return _mm256_castsi256_ps(slli<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), seti(127)))); }
  // y where x >= lo, else 0 (NaN included).
  static F keep_at_least(F y, F x, float lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, set1(lo), _CMP_GE_OQ)); }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F y) { _mm256_storeu_ps(p, y); }
  static void store(float* o, F y, const float* bias, int64_t ncols) {
    if (bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(bias));
    if (ncols == kCols) {
      _mm256_storeu_ps(o, y);
    } else {
      float tmp[kCols];
      _mm256_storeu_ps(tmp, y);
      std::memcpy(o, tmp, ncols * sizeof(float));
    }
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f")
// Two tiles' 16 columns in a zmm (the first tile in the low half).
struct V16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kTiles = 2;
  static constexpr int64_t kCols = 16;
  static I ld(const uint8_t* p, int64_t s) { return pair512(p, p + s); }
  static F ph(const uint8_t* p, int64_t s) { return halves512(p, p + s); }
  static F bf(const uint8_t* p, int64_t s) {
    const __m256i h = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + s)),
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m128i bytes(const uint8_t* p, int64_t s) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + s)));
  }
  static I u8i(const uint8_t* p, int64_t s) { return _mm512_cvtepu8_epi32(bytes(p, s)); }
  static F u8(const uint8_t* p, int64_t s) { return _mm512_cvtepi32_ps(u8i(p, s)); }
  static F i8(const uint8_t* p, int64_t s) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(p, s))); }
  static F lookup16(const float* table, I idx) { return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(table)); }
  template <int S> static I srli(I a) { return _mm512_srli_epi32(a, S); }
  template <int S> static I slli(I a) { return _mm512_slli_epi32(a, S); }
  template <int S> static I srai(I a) { return _mm512_srai_epi32(a, S); }
  // 16-bit lanes take AVX512BW, which the fp32 op's AVX-512 path does not ask for.
  template <int S> __attribute__((target("avx512f,avx512bw"))) static I srli16(I a) { return _mm512_srli_epi16(a, S); }
  template <int S> __attribute__((target("avx512f,avx512bw"))) static I slli16(I a) { return _mm512_slli_epi16(a, S); }
  static I set8(char v) { return _mm512_set1_epi8(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I seti(int v) { return _mm512_set1_epi32(v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F neg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) { return _mm512_castsi512_ps(slli<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), seti(127)))); }
  static F keep_at_least(F y, F x, float lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(lo), _CMP_GE_OQ), y); }
  static F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F y) { _mm512_storeu_ps(p, y); }
  static void store(float* o, F y, const float* bias, int64_t) {  // whole vectors only
    if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(o, y);
  }
};

#pragma GCC pop_options

}  // namespace pagedserve::quant
