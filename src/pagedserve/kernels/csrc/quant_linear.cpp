// y = x W^T + b with W in llama.cpp's blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4: quant_linear.h's packed tiles), x fp32 quantised to int8 per 32
// values.
//
// Why: a decode step reads every weight once per step; fp32 weights make batch-1 decode
// memory-bound at ~540 MB a token on this model, Q8_0 cuts that ~3.8x and Q4_1 ~6.4x,
// and torch has no fast weight-only int8/int4 kernel for AVX2 (docs/benchmarks.md).
//
// How: activations are quantised per row, per block of 32, to int8 with one fp32 scale
// (symmetric, +-127, so the maddubs pair sums cannot saturate int16). Weights are repacked
// once into tiles of 8 output columns (see tile_bytes) so that a 4-byte broadcast of a
// row's activations meets 8 columns in one maddubs and each weight load serves up to 4
// rows (kRowTile): the integer dot of a block lands as 8 int32 lanes = the 8 columns'
// results, scaled by (weight scale x activation scale) with one fp32 FMA per block.
// Q4_0 is run as Q4_1 with m = -8d, so 4-bit weights stay unsigned nibbles and the
// offset becomes a per-block term m * (activation scale x sum of the block's int8 values).
//
// Where the CPU has AVX512_VNNI, whole groups of four tiles run through vpdpbusd instead
// (quad_dot_vnni): one instruction does the 64 byte products and their 4-by-4 sums that
// maddubs + madd do in two on half the width. The integer dots are exact either way and
// the fp32 steps after them are the same operations in the same order, so both paths
// give the same bits.
#include "quant_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "isa.h"
#include "tiles512.h"
#include "tile_vectors.h"
#include "vec.h"

namespace pagedserve::quant {
namespace {

constexpr int64_t kRowTile = 4;  // rows sharing each weight load; 4 fp32 accumulators + temporaries fit 16 ymm

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// One row of fp32 -> int8 per block of 32: scale = amax / 127, q = round-half-even(x * 127 / amax)
// (llama.cpp's quantize_row_q8_0 with an fp32 scale), scale * sum(q) for the Q4 min term and
// the integer sums of q over each 16 values (Q6_K's per-16 offset).
void quantize_row(const float* x, int64_t nb, int8_t* q, float* scale, float* scaled_sum, int32_t* half_sums) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float max_abs = _mm_cvtss_f32(m4);
    const float inv = max_abs != 0.0f ? 127.0f / max_abs : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i iv[4];
    __m256i isum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      isum = _mm256_add_epi32(isum, iv[i]);
    }
    // Pack 4 x 8 int32 to 32 int8; packs works per 128-bit lane, the permute restores order.
    const __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]);
    const __m256i p23 = _mm256_packs_epi32(iv[2], iv[3]);
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p);
    const float d = max_abs / 127.0f;
    scale[b] = d;
    scaled_sum[b] = d * static_cast<float>(hsum_epi32(isum));
    half_sums[2 * b] = hsum_epi32(_mm256_add_epi32(iv[0], iv[1]));
    half_sums[2 * b + 1] = hsum_epi32(_mm256_add_epi32(iv[2], iv[3]));
  }
}

// Q2_K's min term per 16 values: activation scale x the half's integer sum, as both paths
// compute it.
inline float half_scaled_sum(float scale, int32_t half_sum) { return scale * static_cast<float>(half_sum); }

// Where block b's tile and its super-block's header are, from a tile group's start.
template <int64_t kType>
inline const uint8_t* block_tile(const uint8_t* group, int64_t b, const uint8_t*& hdr) {
  constexpr PackedLayout L = packed_layout(kType);
  hdr = group + (b / L.blocks) * L.super_bytes();
  return hdr + L.header + (b % L.blocks) * L.tile;
}

// The fp32 ops' formats, for each nibble block's per-column (d, m): the very numbers the
// fp32 op makes (for Q6_K, d of the 16 values of a half; its m is not used here); and the
// code bytes and block order this op takes from them.
namespace avx2 {
#include "tile_formats.inc"
}  // namespace avx2

// tile_dot's step for Q8_0 block b: signed weights by signed activations, maddubs taking
// |w| and the activations given w's sign; acc += dot * (d * activation scale).
template <int MR>
[[gnu::always_inline]] inline void q8_block_dot(const uint8_t* t, const int8_t* qa, int64_t k, int64_t b, int64_t nb,
                                                const float* da, __m256i ones, __m256 (&acc)[MR]) {
  __m256i isum[MR];
  for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 16 + 32 * c));
    const __m256i w_abs = _mm256_abs_epi8(w);
    for (int r = 0; r < MR; ++r) {
      const __m256i a = _mm256_set1_epi32(load_i32(qa + r * k + b * kBlock + 4 * c));
      const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
    }
  }
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
  for (int r = 0; r < MR; ++r)
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, _mm256_set1_ps(da[r * nb + b])), acc[r]);
}

// tile_dot's MR output rows of ncols (<= 8) columns each, ldo apart, plus the bias where there is one.
template <int MR>
[[gnu::always_inline]] inline void store_tile_rows(__m256 (&acc)[MR], float* out, int64_t ldo, int64_t ncols,
                                                   const float* bias) {
  for (int r = 0; r < MR; ++r) {
    if (bias != nullptr) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(bias));
    if (ncols == kTileCols) {
      _mm256_storeu_ps(out + r * ldo, acc[r]);
    } else {
      float tmp[kTileCols];
      _mm256_storeu_ps(tmp, acc[r]);
      std::memcpy(out + r * ldo, tmp, ncols * sizeof(float));
    }
  }
}

// MR rows x the 8 columns of one tile group, over all K/32 blocks. Per block (Q2_K, Q3_K,
// Q6_K: per 16 values) the integer dot of codes and int8 activations lands as 8 int32 lanes,
// then acc += dot * (d * activation scale) + m * (activation scale * sum of the activations);
// Q6_K's m = -32 d (Q3_K's -4 d) is taken as 32 (4) * the integer activation sum off the dot.
template <int MR, int64_t kType>
void tile_dot(const uint8_t* tiles, int64_t nb, const int8_t* qa, int64_t k, const float* da, const float* sa,
              const int32_t* hs, float* out, int64_t ldo, int64_t ncols, const float* bias) {
  constexpr bool kQ8 = kType == kQ8_0, kSym = sym_offset(kType) != 0, kHalves = per_half(kType),
                 kBook = is_book(kType), kI16 = hi_bits(kType) == 0 && !kBook;
  using Nibbles = avx2::NibbleFormat<V8, kType>;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i book =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(book_of(kType).i8)));
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* hdr;
    const uint8_t* t = block_tile<kType>(tiles, b, hdr);
    if constexpr (kQ8) {
      q8_block_dot<MR>(t, qa, k, b, nb, da, ones, acc);
      continue;
    }
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    // maddubs of codes (<= 63) by int8 (|a| <= 127): a pair sums to <= 16,002, two pairs
    // (one vector) to <= 32,004: int16 holds one vector; codes of 4 bits or fewer hold all
    // four (30,480). A book's signed values (IQ4's |w| <= 127, MXFP4's <= 12) go through maddubs as Q8_0's
    // do, |w| by the activations given w's sign, each product pair widened on its own.
    __m256i i16[MR];
    for (int r = 0; r < MR; ++r) i16[r] = _mm256_setzero_si256();
    __m256 d, m;
    const auto vector = [&](auto vc) {
      constexpr int V = decltype(vc)::value;
      __m256i lo, hi;
      Nibbles::template codes<V>(Nibbles::template load<V>(t, 0), lo, hi);
      if constexpr (kBook) {
        const __m256i wl = _mm256_shuffle_epi8(book, lo), wh = _mm256_shuffle_epi8(book, hi);
        const __m256i wl_abs = _mm256_abs_epi8(wl), wh_abs = _mm256_abs_epi8(wh);
        for (int r = 0; r < MR; ++r) {
          const int8_t* a = qa + r * k + b * kBlock + 8 * V;
          const __m256i pl = _mm256_maddubs_epi16(wl_abs, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(a)), wl));
          const __m256i ph = _mm256_maddubs_epi16(wh_abs, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(a + 4)), wh));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones)));
        }
        return;
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* a = qa + r * k + b * kBlock + 8 * V;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(a))),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(a + 4))));
        if constexpr (kI16) {
          i16[r] = _mm256_add_epi16(i16[r], p);
        } else {
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
        }
      }
    };
    const auto scale_half = [&](int half) {  // acc += the half's (or block's) dot, scaled
      for (int r = 0; r < MR; ++r) {
        if constexpr (kI16) isum[r] = _mm256_madd_epi16(i16[r], ones);
        const __m256 dar = _mm256_set1_ps(da[r * nb + b]);
        const int32_t half_sum = hs[r * 2 * nb + 2 * b + half];
        if constexpr (kSym) {
          const __m256i dot = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(sym_offset(kType) * half_sum));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dar), acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dar), acc[r]);
          if constexpr (!kBook)
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(kHalves ? half_scaled_sum(da[r * nb + b], half_sum) : sa[r * nb + b]),
                                     acc[r]);
        }
        if constexpr (kHalves) isum[r] = i16[r] = _mm256_setzero_si256();
      }
    };
    const auto load_scales = [&](int half) {
      const auto sc = Nibbles::scales(hdr, t, 0, half);
      d = sc.d, m = sc.m;
    };
    Nibbles::int8_block(load_scales, vector, scale_half);
  }
  store_tile_rows<MR>(acc, out, ldo, ncols, bias);
}

template <int64_t kType>
void rows_dot(int64_t rows, const uint8_t* tiles, int64_t nb, const int8_t* qa, int64_t k, const float* da,
              const float* sa, const int32_t* hs, float* out, int64_t ldo, int64_t ncols, const float* bias) {
  switch (rows) {
    case 1: return tile_dot<1, kType>(tiles, nb, qa, k, da, sa, hs, out, ldo, ncols, bias);
    case 2: return tile_dot<2, kType>(tiles, nb, qa, k, da, sa, hs, out, ldo, ncols, bias);
    case 3: return tile_dot<3, kType>(tiles, nb, qa, k, da, sa, hs, out, ldo, ncols, bias);
    default: return tile_dot<4, kType>(tiles, nb, qa, k, da, sa, hs, out, ldo, ncols, bias);
  }
}

// The same dot on AVX512_VNNI for MR rows x one group of four whole tiles (32 columns: two
// zmm, tiles g and g+1 side by side, then g+2 and g+3). vpdpbusd multiplies unsigned by
// signed bytes: codes are the unsigned side as they stand; for Q8_0 the activations are,
// stored + 128 (qa_u8), and 128 x the weights' block sum (a vpdpbusd of 0x80 bytes, shared
// by the rows) is taken off again. The integer dots are exact, and the fp32 steps after
// them are tile_dot's operations in its order: the same bits.
constexpr int64_t kRowTileVnni = 6;  // 2 x 6 int32 + 2 x 6 fp32 accumulators + 4 weight vectors fit the 32 zmm
// Blocks ahead to prefetch: at a few rows the op streams the weights once and is bound by
// memory; the prefetch took a 1-row pass over the model's layers from 0.81x to 0.68x of the
// AVX2 path's time (a hint, so reading past the matrix's end is harmless).
constexpr int64_t kPrefetch = 8;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
namespace avx512 {
#include "tile_formats.inc"
}  // namespace avx512

// quad_dot_vnni's step for Q8_0 block b of tiles t0 .. t3: the activations + 128 (a) by
// the signed weights, less 128 x the weights' sums; acc += dot * (d * activation scale).
template <int MR>
[[gnu::always_inline]] inline void q8_quad_dot(const uint8_t* t0, const uint8_t* t1, const uint8_t* t2,
                                               const uint8_t* t3, const int8_t* a, int64_t k, int64_t b, int64_t nb,
                                               const float* da, __m512 (&acc)[MR][2]) {
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i isum[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
  __m512i corr[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const int64_t off = 16 + 32 * c;
    const __m512i w0 = pair512(t0 + off, t1 + off), w1 = pair512(t2 + off, t3 + off);
    corr[0] = _mm512_dpbusd_epi32(corr[0], offset, w0);
    corr[1] = _mm512_dpbusd_epi32(corr[1], offset, w1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i av = _mm512_set1_epi32(load_i32(a + r * k + 4 * c));
      isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], av, w0);
      isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], av, w1);
    }
  }
  const __m512 dw0 = halves512(t0, t1), dw1 = halves512(t2, t3);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512 dar = _mm512_set1_ps(da[r * nb + b]);
    acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][0], corr[0])), _mm512_mul_ps(dw0, dar), acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][1], corr[1])), _mm512_mul_ps(dw1, dar), acc[r][1]);
  }
}

template <int MR, int64_t kType>
void quad_dot_vnni(const uint8_t* tiles, int64_t stride, int64_t nb, const int8_t* qa, int64_t k, const float* da,
                   const float* sa, const int32_t* hs, float* out, int64_t ldo, const float* bias) {
  constexpr bool kQ8 = kType == kQ8_0, kSym = sym_offset(kType) != 0, kHalves = per_half(kType),
                 kBook = is_book(kType);
  constexpr int64_t kTile = packed_layout(kType).tile;
  using Nibbles = avx512::NibbleFormat<V16, kType>;
  const __m512i book =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(book_of(kType).u8)));
  __m512 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* h0;
    const uint8_t* t0 = block_tile<kType>(tiles, b, h0);
    const uint8_t *t1 = t0 + stride, *t2 = t1 + stride, *t3 = t2 + stride;
    const uint8_t* h2 = h0 + 2 * stride;
    const int8_t* a = qa + b * kBlock;
    for (const uint8_t* t : {t0, t1, t2, t3})
      for (int64_t line = 0; line < kTile; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch * kTile + line), _MM_HINT_T0);
    if constexpr (kQ8) {
      q8_quad_dot<MR>(t0, t1, t2, t3, a, k, b, nb, da, acc);
      continue;
    }
    __m512i isum[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
    __m512 d0, m0, d1, m1;
    const auto vector = [&](auto vc) {
      constexpr int V = decltype(vc)::value;
      __m512i lo0, hi0, lo1, hi1;
      Nibbles::template codes<V>(Nibbles::template load<V>(t0, stride), lo0, hi0);
      Nibbles::template codes<V>(Nibbles::template load<V>(t2, stride), lo1, hi1);
      if constexpr (kBook) {  // the book's values + 128: unsigned, as vpdpbusd takes them
        lo0 = _mm512_shuffle_epi8(book, lo0), hi0 = _mm512_shuffle_epi8(book, hi0);
        lo1 = _mm512_shuffle_epi8(book, lo1), hi1 = _mm512_shuffle_epi8(book, hi1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const int8_t* ar = a + r * k + 8 * V;
        const __m512i alo = _mm512_set1_epi32(load_i32(ar)), ahi = _mm512_set1_epi32(load_i32(ar + 4));
        isum[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][0], lo0, alo), hi0, ahi);
        isum[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][1], lo1, alo), hi1, ahi);
      }
    };
    const auto scale_half = [&](int half) {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 dar = _mm512_set1_ps(da[r * nb + b]);
        const int32_t half_sum = hs[r * 2 * nb + 2 * b + half];
        if constexpr (kSym || kBook) {
          // The book's +128 comes off as 128 x the block's activation sum: tile_dot's integers.
          const int32_t off_sum =
              kBook ? 128 * (hs[r * 2 * nb + 2 * b] + hs[r * 2 * nb + 2 * b + 1]) : sym_offset(kType) * half_sum;
          const __m512i off = _mm512_set1_epi32(off_sum);
          acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][0], off)), _mm512_mul_ps(d0, dar), acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][1], off)), _mm512_mul_ps(d1, dar), acc[r][1]);
        } else {
          acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(d0, dar), acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), _mm512_mul_ps(d1, dar), acc[r][1]);
          const __m512 sar = _mm512_set1_ps(kHalves ? half_scaled_sum(da[r * nb + b], half_sum) : sa[r * nb + b]);
          acc[r][0] = _mm512_fmadd_ps(m0, sar, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(m1, sar, acc[r][1]);
        }
        if constexpr (kHalves) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
      }
    };
    const auto load_scales = [&](int half) {
      const auto s0 = Nibbles::scales(h0, t0, stride, half), s1 = Nibbles::scales(h2, t2, stride, half);
      d0 = s0.d, m0 = s0.m, d1 = s1.d, m1 = s1.m;
    };
    Nibbles::int8_block(load_scales, vector, scale_half);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    store_row512(out + r * ldo, acc[r][0], acc[r][1], bias);
  }
}
#pragma GCC pop_options

template <int64_t kType>
void rows_quad_vnni(int64_t rows, const uint8_t* tiles, int64_t stride, int64_t nb, const int8_t* qa, int64_t k,
                    const float* da, const float* sa, const int32_t* hs, float* out, int64_t ldo, const float* bias) {
  switch (rows) {
    case 1: return quad_dot_vnni<1, kType>(tiles, stride, nb, qa, k, da, sa, hs, out, ldo, bias);
    case 2: return quad_dot_vnni<2, kType>(tiles, stride, nb, qa, k, da, sa, hs, out, ldo, bias);
    case 3: return quad_dot_vnni<3, kType>(tiles, stride, nb, qa, k, da, sa, hs, out, ldo, bias);
    case 4: return quad_dot_vnni<4, kType>(tiles, stride, nb, qa, k, da, sa, hs, out, ldo, bias);
    case 5: return quad_dot_vnni<5, kType>(tiles, stride, nb, qa, k, da, sa, hs, out, ldo, bias);
    default: return quad_dot_vnni<6, kType>(tiles, stride, nb, qa, k, da, sa, hs, out, ldo, bias);
  }
}

// 128 + each int8 value: the unsigned side of vpdpbusd for Q8_0 weights.
void offset_bytes(const int8_t* src, int64_t n, int8_t* dst) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), flip));
  for (; i < n; ++i) dst[i] = static_cast<int8_t>(src[i] ^ 0x80);
}

// One tile group's rows on the AVX2 path, or four groups' on VNNI, for GGML type kType.
template <int64_t kType>
void run_groups(int64_t g0, int64_t g1, bool quad, int64_t m, const uint8_t* tiles, int64_t stride, int64_t nb,
                const int8_t* qa, int64_t k, const float* da, const float* sa, const int32_t* hs, float* dst,
                int64_t out_features, const float* bias) {
  if (quad) {
    const float* bias_g = bias ? bias + g0 * kTileCols : nullptr;
    for (int64_t r = 0; r < m; r += kRowTileVnni) {
      const int64_t rows = std::min(kRowTileVnni, m - r);
      rows_quad_vnni<kType>(rows, tiles + g0 * stride, stride, nb, qa + r * k, k, da + r * nb, sa + r * nb,
                            hs + r * 2 * nb, dst + r * out_features + g0 * kTileCols, out_features, bias_g);
    }
    return;
  }
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t ncols = std::min(kTileCols, out_features - g * kTileCols);
    const float* bias_g = bias ? bias + g * kTileCols : nullptr;
    for (int64_t r = 0; r < m; r += kRowTile) {
      const int64_t rows = std::min(kRowTile, m - r);
      rows_dot<kType>(rows, tiles + g * stride, nb, qa + r * k, k, da + r * nb, sa + r * nb, hs + r * 2 * nb,
                      dst + r * out_features + g * kTileCols, out_features, ncols, bias_g);
    }
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!is_half(qtype), "quant_linear: F16 / BF16 weights have no int8 form; dequant_linear reads them");
  auto [in, out, bias_padded, k, nb, ng, m] = check_tiled_linear("quant_linear", x, packed, qtype, out_features, bias);
  if (m == 0) return out;

  const bool vnni = use_avx512_vnni();
  const Int8Activations act = quantize_activations(in.data_ptr<float>(), m, k, vnni && qtype == kQ8_0, x.options());
  const uint8_t* tiles = packed.data_ptr<uint8_t>();
  const int64_t stride = packed.size(1) * packed.size(2);  // bytes from one tile group to the next
  const float* bias_ptr = bias.has_value() ? bias_padded.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  mark_isa_path(vnni ? IsaPath::kQuantLinearAvx512Vnni : IsaPath::kQuantLinearAvx2);
  // Columns are split across threads (even the 1-row case has >= 72 tile groups on this
  // model), four tiles at a time for VNNI; each task keeps its tiles' weights in cache
  // while it walks the rows.
  const int64_t unit = quant_task_groups(vnni), units = (ng + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, m * k * kTileCols * unit));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u)
      quant_tiles(qtype, u * unit, std::min(ng, (u + 1) * unit), m, tiles, stride, act.rows, dst, out_features,
                  bias_ptr, vnni);
  });
  return out;
}

}  // namespace

Int8Activations quantize_activations(const float* x, int64_t m, int64_t k, bool with_offset,
                                     const at::TensorOptions& options) {
  const int64_t nb = k / kBlock;
  Int8Activations a;
  a.q = at::empty({m, k}, options.dtype(at::kChar));
  a.scales = at::empty({2, m, nb}, options.dtype(at::kFloat));
  a.half_sums = at::empty({m, 2 * nb}, options.dtype(at::kInt));
  int8_t* q = a.q.data_ptr<int8_t>();
  float* da = a.scales.data_ptr<float>();
  float* sa = da + m * nb;
  int32_t* hs = a.half_sums.data_ptr<int32_t>();
  at::parallel_for(0, m, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * k, nb, q + r * k, da + r * nb, sa + r * nb, hs + r * 2 * nb);
  });
  if (with_offset) {
    a.q_offset = at::empty_like(a.q);
    offset_bytes(q, m * k, a.q_offset.data_ptr<int8_t>());
  }
  a.rows = {q, with_offset ? a.q_offset.data_ptr<int8_t>() : nullptr, da, sa, hs, k, nb};
  return a;
}

void quant_tiles(int64_t qtype, int64_t g0, int64_t g1, int64_t m, const uint8_t* tiles, int64_t stride,
                 const Int8Rows& a, float* out, int64_t out_features, const float* bias, bool vnni) {
  const bool quad = vnni && g1 - g0 == 4 && out_features >= g1 * kTileCols;
  const bool q8 = qtype == kQ8_0;
  TORCH_CHECK(!(quad && q8) || a.q_offset != nullptr, "quant_tiles: Q8_0 on VNNI needs the offset activations");
  const int8_t* q = quad && q8 ? a.q_offset : a.q;
  switch (qtype) {
#define PAGEDSERVE_RUN(T) \
  run_groups<T>(g0, g1, quad, m, tiles, stride, a.nb, q, a.k, a.scale, a.scaled_sum, a.half_sums, out, out_features, bias)
    case kQ8_0: PAGEDSERVE_RUN(kQ8_0); break;
    case kQ4_0:  // Q4_0's tiles are Q4_1's (m = -8d), Q5_0's Q5_1's (m = -16d)
    case kQ4_1: PAGEDSERVE_RUN(kQ4_1); break;
    case kQ5_0:
    case kQ5_1: PAGEDSERVE_RUN(kQ5_1); break;
    case kQ2_K: PAGEDSERVE_RUN(kQ2_K); break;
    case kQ3_K: PAGEDSERVE_RUN(kQ3_K); break;
    case kQ4_K: PAGEDSERVE_RUN(kQ4_K); break;
    case kQ5_K: PAGEDSERVE_RUN(kQ5_K); break;
    case kQ6_K: PAGEDSERVE_RUN(kQ6_K); break;
    case kIQ4_NL: PAGEDSERVE_RUN(kIQ4_NL); break;
    case kIQ4_XS: PAGEDSERVE_RUN(kIQ4_XS); break;
    case kMXFP4: PAGEDSERVE_RUN(kMXFP4); break;
#undef PAGEDSERVE_RUN
    default: TORCH_CHECK(false, "quant_tiles: qtype ", qtype, " has no int8 form");
  }
}

TiledLinear check_tiled_linear(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                               int64_t out_features, const std::optional<at::Tensor>& bias) {
  const PackedLayout layout = packed_layout(qtype);
  TORCH_CHECK(layout.blocks != 0, op, ": qtype ", qtype, " is not a GGML type id quant_repack packs");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, op, ": x must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == layout.super_bytes(),
              op, ": packed must come from quant_repack with the same qtype");
  TiledLinear a;
  a.k = x.size(-1);
  a.nb = packed.size(1) * layout.blocks;
  a.ng = packed.size(0);
  TORCH_CHECK(a.k == a.nb * kBlock, op, ": x has ", a.k, " input features, the weight ", a.nb * kBlock);
  TORCH_CHECK(out_features > (a.ng - 1) * kTileCols && out_features <= a.ng * kTileCols, op, ": out_features ",
              out_features, " does not match the packed weight");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == out_features, op,
                ": bias must be float32 [out_features]");
    a.bias_padded = at::zeros({a.ng * kTileCols}, bias->options());
    a.bias_padded.narrow(0, 0, out_features).copy_(*bias);
  }
  a.in = x.contiguous();
  a.m = a.k ? a.in.numel() / a.k : 0;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  a.out = at::empty(out_shape, x.options());
  return a;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int qtype, int out_features, Tensor? bias) -> Tensor", &quant_linear);
}

}  // namespace pagedserve::quant
