// The element types a KV cache may hold (`--kv-cache-dtype`) and their 8-lane
// conversions to fp32 (F16C). Stores round as torch's `.to()` does, so the native and
// torch paths write the same bits; narrow types saturate at their largest finite value
// (torch's conversion would give inf), as vLLM's scaled fp8 writes do.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "vec.h"

namespace pagedserve {

template <typename T>
struct KVType;

template <>
struct KVType<float> {
  // What load8 returns is the stored value times this (1 where the conversion is exact).
  static constexpr float kLoadFactor = 1.0f;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float from_float(float x) { return x; }
};

template <>
struct KVType<c10::Half> {
  static constexpr float kLoadFactor = 1.0f;
  static constexpr float kMax = 65504.0f;
  static __m256 load8(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static c10::Half from_float(float x) { return c10::Half(std::clamp(x, -kMax, kMax)); }
  static __m128i from_float8(__m256 x) {
    const __m256 limit = _mm256_set1_ps(kMax);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

// e5m2 is the top byte of an fp16: widen and shift.
template <>
struct KVType<c10::Float8_e5m2> {
  static constexpr float kLoadFactor = 1.0f;
  static constexpr float kMax = 57344.0f;
  static __m256 load8(const c10::Float8_e5m2* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
  }
  static c10::Float8_e5m2 from_float(float x) { return c10::Float8_e5m2(std::clamp(x, -kMax, kMax)); }
};

// e4m3 (bias 7) placed in an fp16 (bias 15) as s.0eeee.mmm0000000 reads as the value
// times 2^-8, subnormals included; the caller multiplies the 2^8 back in once (kLoadFactor).
template <>
struct KVType<c10::Float8_e4m3fn> {
  static constexpr float kLoadFactor = 1.0f / 256.0f;
  static constexpr float kMax = 448.0f;
  static __m256 load8(const c10::Float8_e4m3fn* p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, magnitude));
  }
  static c10::Float8_e4m3fn from_float(float x) { return c10::Float8_e4m3fn(std::clamp(x, -kMax, kMax)); }
};

// Calls f with a null pointer of the cache's element type, or fails naming the op.
template <typename F>
void dispatch_kv_type(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    case at::kFloat8_e5m2: f(static_cast<c10::Float8_e5m2*>(nullptr)); break;
    case at::kFloat8_e4m3fn: f(static_cast<c10::Float8_e4m3fn*>(nullptr)); break;
    default: TORCH_CHECK(false, op, ": KV cache dtype must be float32, float16, float8_e5m2 or float8_e4m3fn, not ", type);
  }
}

}  // namespace pagedserve
