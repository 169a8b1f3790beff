// y = x W^T + b with W in llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks (quant_linear.h), x fp32.
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

#include "isa.h"
#include "tiles512.h"
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
// (llama.cpp's quantize_row_q8_0 with an fp32 scale), and scale * sum(q) for the Q4 min term.
void quantize_row(const float* x, int64_t nb, int8_t* q, float* scale, float* scaled_sum) {
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
  }
}

// MR rows x the 8 columns of one tile group, over all K/32 blocks.
template <int MR, bool kQ8>
void tile_dot(const uint8_t* tiles, int64_t nb, const int8_t* qa, int64_t k, const float* da, const float* sa,
              float* out, int64_t ldo, int64_t ncols, const float* bias) {
  const int64_t tb = kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * tb;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
    __m256i isum[MR];
    if constexpr (kQ8) {
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
    } else {
      // Eight maddubs of nibbles (<= 15) by int8 (|a| <= 127) sum to <= 30,480: int16 holds them.
      __m256i i16[MR];
      for (int r = 0; r < MR; ++r) i16[r] = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 32 * v));
        const __m256i lo = _mm256_and_si256(raw, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
        for (int r = 0; r < MR; ++r) {
          const int8_t* a = qa + r * k + b * kBlock + 8 * v;
          i16[r] = _mm256_add_epi16(i16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(a))));
          i16[r] = _mm256_add_epi16(i16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(a + 4))));
        }
      }
      for (int r = 0; r < MR; ++r) isum[r] = _mm256_madd_epi16(i16[r], ones);
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, _mm256_set1_ps(da[r * nb + b])), acc[r]);
    if constexpr (!kQ8) {
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16)));
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[r * nb + b]), acc[r]);
    }
  }
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

template <bool kQ8>
void rows_dot(int64_t rows, const uint8_t* tiles, int64_t nb, const int8_t* qa, int64_t k, const float* da,
              const float* sa, float* out, int64_t ldo, int64_t ncols, const float* bias) {
  switch (rows) {
    case 1: return tile_dot<1, kQ8>(tiles, nb, qa, k, da, sa, out, ldo, ncols, bias);
    case 2: return tile_dot<2, kQ8>(tiles, nb, qa, k, da, sa, out, ldo, ncols, bias);
    case 3: return tile_dot<3, kQ8>(tiles, nb, qa, k, da, sa, out, ldo, ncols, bias);
    default: return tile_dot<4, kQ8>(tiles, nb, qa, k, da, sa, out, ldo, ncols, bias);
  }
}

// The same dot on AVX512_VNNI for MR rows x one group of four whole tiles (32 columns: two
// zmm, tiles g and g+1 side by side, then g+2 and g+3). vpdpbusd multiplies unsigned by
// signed bytes: Q4 nibbles are the unsigned side as they stand; for Q8_0 the activations
// are, stored + 128 (qa_u8), and 128 x the weights' block sum (a vpdpbusd of 0x80 bytes,
// shared by the rows) is taken off again.
constexpr int64_t kRowTileVnni = 6;  // 2 x 6 int32 + 2 x 6 fp32 accumulators + 4 weight vectors fit the 32 zmm
// Blocks ahead to prefetch: at a few rows the op streams the weights once and is bound by
// memory; the prefetch took a 1-row pass over the model's layers from 0.81x to 0.68x of the
// AVX2 path's time (a hint, so reading past the matrix's end is harmless).
constexpr int64_t kPrefetch = 8;

template <int MR, bool kQ8>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void quad_dot_vnni(
    const uint8_t* tiles, int64_t stride, int64_t nb, const int8_t* qa, int64_t k, const float* da, const float* sa,
    float* out, int64_t ldo, const float* bias) {
  const int64_t tb = kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t0 = tiles + b * tb;
    const uint8_t *t1 = t0 + stride, *t2 = t1 + stride, *t3 = t2 + stride;
    const int8_t* a = qa + b * kBlock;
    for (const uint8_t* t : {t0, t1, t2, t3})
      for (int64_t line = 0; line < tb; line += 64) _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch * tb + line), _MM_HINT_T0);
    __m512i isum[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
    if constexpr (kQ8) {
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
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        isum[r][0] = _mm512_sub_epi32(isum[r][0], corr[0]);
        isum[r][1] = _mm512_sub_epi32(isum[r][1], corr[1]);
      }
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < 4; ++v) {
        const int64_t off = 32 + 32 * v;
        const __m512i raw0 = pair512(t0 + off, t1 + off), raw1 = pair512(t2 + off, t3 + off);
        const __m512i lo0 = _mm512_and_si512(raw0, low_nibbles), lo1 = _mm512_and_si512(raw1, low_nibbles);
        const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(raw0, 4), low_nibbles);
        const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(raw1, 4), low_nibbles);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int8_t* ar = a + r * k + 8 * v;
          const __m512i alo = _mm512_set1_epi32(load_i32(ar)), ahi = _mm512_set1_epi32(load_i32(ar + 4));
          isum[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][0], lo0, alo), hi0, ahi);
          isum[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][1], lo1, alo), hi1, ahi);
        }
      }
    }
    const __m512 dw0 = halves512(t0, t1), dw1 = halves512(t2, t3);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 dar = _mm512_set1_ps(da[r * nb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(dw0, dar), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), _mm512_mul_ps(dw1, dar), acc[r][1]);
    }
    if constexpr (!kQ8) {
      const __m512 mw0 = halves512(t0 + 16, t1 + 16), mw1 = halves512(t2 + 16, t3 + 16);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 sar = _mm512_set1_ps(sa[r * nb + b]);
        acc[r][0] = _mm512_fmadd_ps(mw0, sar, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(mw1, sar, acc[r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    store_row512(out + r * ldo, acc[r][0], acc[r][1], bias);
  }
}

template <bool kQ8>
void rows_quad_vnni(int64_t rows, const uint8_t* tiles, int64_t stride, int64_t nb, const int8_t* qa, int64_t k,
                    const float* da, const float* sa, float* out, int64_t ldo, const float* bias) {
  switch (rows) {
    case 1: return quad_dot_vnni<1, kQ8>(tiles, stride, nb, qa, k, da, sa, out, ldo, bias);
    case 2: return quad_dot_vnni<2, kQ8>(tiles, stride, nb, qa, k, da, sa, out, ldo, bias);
    case 3: return quad_dot_vnni<3, kQ8>(tiles, stride, nb, qa, k, da, sa, out, ldo, bias);
    case 4: return quad_dot_vnni<4, kQ8>(tiles, stride, nb, qa, k, da, sa, out, ldo, bias);
    case 5: return quad_dot_vnni<5, kQ8>(tiles, stride, nb, qa, k, da, sa, out, ldo, bias);
    default: return quad_dot_vnni<6, kQ8>(tiles, stride, nb, qa, k, da, sa, out, ldo, bias);
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

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "quant_linear: qtype must be a GGML type id of Q4_0 (2), Q4_1 (3) or Q8_0 (8), got ", qtype);
  auto [in, out, bias_padded, k, nb, ng, m] = check_tiled_linear("quant_linear", x, packed, qtype, out_features, bias);
  if (m == 0) return out;

  at::Tensor qa = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, m, nb}, x.options());
  const float* src = in.data_ptr<float>();
  int8_t* qa_ptr = qa.data_ptr<int8_t>();
  float* da = scales.data_ptr<float>();
  float* sa = da + m * nb;
  at::parallel_for(0, m, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(src + r * k, nb, qa_ptr + r * k, da + r * nb, sa + r * nb);
  });

  const uint8_t* tiles = packed.data_ptr<uint8_t>();
  const int64_t tb = packed.size(2);
  const float* bias_ptr = bias.has_value() ? bias_padded.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  const bool q8 = qtype == kQ8_0, vnni = use_avx512_vnni();
  mark_isa_path(vnni ? IsaPath::kQuantLinearAvx512Vnni : IsaPath::kQuantLinearAvx2);
  at::Tensor qa_u8;
  if (vnni && q8) {
    qa_u8 = at::empty_like(qa);
    offset_bytes(qa_ptr, m * k, qa_u8.data_ptr<int8_t>());
  }
  // Columns are split across threads (even the 1-row case has >= 72 tile groups on this
  // model), four tiles at a time for VNNI; each task keeps its tiles' weights in cache
  // while it walks the rows.
  const int64_t unit = vnni ? 4 : 1, units = (ng + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, m * k * kTileCols * unit));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g0 = u * unit, g1 = std::min(ng, g0 + unit);
      if (vnni && g1 - g0 == 4 && out_features >= g1 * kTileCols) {
        const float* bias_g = bias_ptr ? bias_ptr + g0 * kTileCols : nullptr;
        const int8_t* a = q8 ? qa_u8.data_ptr<int8_t>() : qa_ptr;
        for (int64_t r = 0; r < m; r += kRowTileVnni) {
          const int64_t rows = std::min(kRowTileVnni, m - r);
          float* o = dst + r * out_features + g0 * kTileCols;
          if (q8)
            rows_quad_vnni<true>(rows, tiles + g0 * nb * tb, nb * tb, nb, a + r * k, k, da + r * nb, sa + r * nb, o, out_features, bias_g);
          else
            rows_quad_vnni<false>(rows, tiles + g0 * nb * tb, nb * tb, nb, a + r * k, k, da + r * nb, sa + r * nb, o, out_features, bias_g);
        }
        continue;
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t ncols = std::min(kTileCols, out_features - g * kTileCols);
        const float* bias_g = bias_ptr ? bias_ptr + g * kTileCols : nullptr;
        for (int64_t r = 0; r < m; r += kRowTile) {
          const int64_t rows = std::min(kRowTile, m - r);
          float* o = dst + r * out_features + g * kTileCols;
          if (q8)
            rows_dot<true>(rows, tiles + g * nb * tb, nb, qa_ptr + r * k, k, da + r * nb, sa + r * nb, o, out_features, ncols, bias_g);
          else
            rows_dot<false>(rows, tiles + g * nb * tb, nb, qa_ptr + r * k, k, da + r * nb, sa + r * nb, o, out_features, ncols, bias_g);
        }
      }
    }
  });
  return out;
}

}  // namespace

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
