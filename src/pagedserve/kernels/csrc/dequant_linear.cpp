// y = x W^T + b in fp32, W read from the packed Q8_0 / Q4_0 / Q4_1 tiles of quant_linear
// (quant_repack) and dequantised in registers: the fp32 model a GGUF file defines, at the
// file's bytes per weight.
//
// Why: a GGUF's fp32 model is its blocks dequantised (w = d * q + m), so an fp32 layer built
// from the file holds nothing the blocks do not; reading the blocks instead of the inflated
// fp32 matrix moves ~0.16x (Q4_1) or ~0.27x (Q8_0) of the bytes, and batch-1 decode is bound
// by those bytes. Unlike quant_linear the activations stay fp32, so the arithmetic is the fp32
// model's: d * q is exact in fp32 (an 11-bit significand times at most 8 bits), hence so is
// fma(q, d, m) = d * q + m rounded once, the value the loader's dequantisation gives.
//
// Order: lane j of an accumulator is output column j, and each lane adds x[k] * w[k] for k =
// 0, 1, ..., K-1, one fma per k. Row and column tiling, thread count and vector width change
// which lanes are computed together, never the order within a lane, so a row's outputs are
// the same bits whatever batch it is in (and what the reference in tests computes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "isa.h"
#include "quant_linear.h"
#include "tiles512.h"
#include "vec.h"

namespace pagedserve::quant {
namespace {

// The 32 weights of lane j's block, one ymm per k: column j's value k in lane j.
// Q4: vector v's lane holds 4 bytes; low nibble of byte t is k = 8v + t, high nibble 8v + 4 + t.
template <int S>
inline __m256 q4_at(__m256i raw, __m256i low4, __m256 d, __m256 m) {
  const __m256i q = S == 28 ? _mm256_srli_epi32(raw, 28) : _mm256_and_si256(_mm256_srli_epi32(raw, S), low4);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

// Q8: chunk c's lane holds 4 signed bytes, byte t is k = 4c + t.
template <int T>
inline __m256 q8_at(__m256i raw, __m256 d) {
  const __m256i q = _mm256_srai_epi32(T == 3 ? raw : _mm256_slli_epi32(raw, 24 - 8 * T), 24);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
}

template <int MR, int NT>
struct Tile {
  __m256 acc[MR][NT];

  // k is the input index; w[t] the tile t weights at k. One fma per (row, tile).
  inline void step(const float* x, int64_t ldx, int64_t k, const __m256 (&w)[NT]) {
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(xv, w[t], acc[r][t]);
    }
  }
};

// MR rows x NT tiles (8 columns each) over all K/32 blocks. `tiles` is the first tile
// group's blocks; group t's are `group_stride` bytes further.
template <int MR, int NT, bool kQ8>
void dq_tile(const uint8_t* tiles, int64_t group_stride, int64_t nb, const float* x, int64_t ldx, float* out,
             int64_t ldo, int64_t ncols_last, const float* bias) {
  const int64_t tb = kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  Tile<MR, NT> tile;
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) tile.acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 d[NT], m[NT];
    const uint8_t* blk[NT];
    for (int t = 0; t < NT; ++t) {
      blk[t] = tiles + t * group_stride + b * tb;
      d[t] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[t])));
      if constexpr (!kQ8) m[t] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[t] + 16)));
    }
    const int64_t k0 = b * kBlock;
    if constexpr (kQ8) {
      for (int c = 0; c < 8; ++c) {
        __m256i raw[NT];
        for (int t = 0; t < NT; ++t) raw[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[t] + 16 + 32 * c));
        __m256 w[NT];
        const int64_t k = k0 + 4 * c;
        for (int t = 0; t < NT; ++t) w[t] = q8_at<0>(raw[t], d[t]);
        tile.step(x, ldx, k, w);
        for (int t = 0; t < NT; ++t) w[t] = q8_at<1>(raw[t], d[t]);
        tile.step(x, ldx, k + 1, w);
        for (int t = 0; t < NT; ++t) w[t] = q8_at<2>(raw[t], d[t]);
        tile.step(x, ldx, k + 2, w);
        for (int t = 0; t < NT; ++t) w[t] = q8_at<3>(raw[t], d[t]);
        tile.step(x, ldx, k + 3, w);
      }
    } else {
      for (int v = 0; v < 4; ++v) {
        __m256i raw[NT];
        for (int t = 0; t < NT; ++t) raw[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[t] + 32 + 32 * v));
        __m256 w[NT];
        const int64_t k = k0 + 8 * v;
#define PAGEDSERVE_Q4_STEP(S, K_OFF)                                               \
  for (int t = 0; t < NT; ++t) w[t] = q4_at<S>(raw[t], low4, d[t], m[t]); \
  tile.step(x, ldx, k + (K_OFF), w);
        PAGEDSERVE_Q4_STEP(0, 0)
        PAGEDSERVE_Q4_STEP(8, 1)
        PAGEDSERVE_Q4_STEP(16, 2)
        PAGEDSERVE_Q4_STEP(24, 3)
        PAGEDSERVE_Q4_STEP(4, 4)
        PAGEDSERVE_Q4_STEP(12, 5)
        PAGEDSERVE_Q4_STEP(20, 6)
        PAGEDSERVE_Q4_STEP(28, 7)
#undef PAGEDSERVE_Q4_STEP
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int t = 0; t < NT; ++t) {
      __m256 y = tile.acc[r][t];
      if (bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + t * kTileCols));
      float* o = out + r * ldo + t * kTileCols;
      const int64_t ncols = t == NT - 1 ? ncols_last : kTileCols;
      if (ncols == kTileCols) {
        _mm256_storeu_ps(o, y);
      } else {
        float tmp[kTileCols];
        _mm256_storeu_ps(tmp, y);
        std::memcpy(o, tmp, ncols * sizeof(float));
      }
    }
  }
}

// Dequantises `nt` tiles' values k0 .. k0 + kc - 1 into buf[kk][t * 8 + j] (fp32), the
// same values dq_tile computes in registers.
template <bool kQ8>
void dequant_chunk(const uint8_t* tiles, int64_t group_stride, int nt, int64_t k0, int64_t kc, float* buf,
                   int64_t ldb) {
  const int64_t tb = kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int t = 0; t < nt; ++t) {
    float* dst = buf + t * kTileCols;
    for (int64_t b = k0 / kBlock; b < (k0 + kc) / kBlock; ++b) {
      const uint8_t* blk = tiles + t * group_stride + b * tb;
      float* o = dst + (b * kBlock - k0) * ldb;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      if constexpr (kQ8) {
        for (int c = 0; c < 8; ++c) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
          _mm256_storeu_ps(o + (4 * c) * ldb, q8_at<0>(raw, d));
          _mm256_storeu_ps(o + (4 * c + 1) * ldb, q8_at<1>(raw, d));
          _mm256_storeu_ps(o + (4 * c + 2) * ldb, q8_at<2>(raw, d));
          _mm256_storeu_ps(o + (4 * c + 3) * ldb, q8_at<3>(raw, d));
        }
      } else {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
        for (int v = 0; v < 4; ++v) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * v));
          float* ov = o + 8 * v * ldb;
          _mm256_storeu_ps(ov, q4_at<0>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 1 * ldb, q4_at<8>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 2 * ldb, q4_at<16>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 3 * ldb, q4_at<24>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 4 * ldb, q4_at<4>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 5 * ldb, q4_at<12>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 6 * ldb, q4_at<20>(raw, low4, d, m));
          _mm256_storeu_ps(ov + 7 * ldb, q4_at<28>(raw, low4, d, m));
        }
      }
    }
  }
}

// acc (MR rows x NT tiles, kept in `out` between chunks) += x[:, k0:k0+kc] * buf: the
// classic register-blocked fp32 micro-kernel, one fma per (row, column, k) in k order.
template <int MR, int NT>
void gemm_chunk(const float* x, int64_t ldx, int64_t k0, int64_t kc, const float* buf, int64_t ldb, float* acc_out,
                int64_t ldo, bool first) {
  // Whole-array updates with constant trip counts: gcc keeps the accumulators in ymm
  // registers only when no element is written conditionally.
  __m256 acc[MR][NT];
  if (first) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_loadu_ps(acc_out + r * ldo + t * kTileCols);
  }
  const float* xk = x + k0;
  const float* bk = buf;
  for (int64_t kk = 0; kk < kc; ++kk, ++xk, bk += ldb) {
    __m256 w[NT];
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) w[t] = _mm256_loadu_ps(bk + t * kTileCols);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xk + r * ldx);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(xv, w[t], acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) _mm256_storeu_ps(acc_out + r * ldo + t * kTileCols, acc[r][t]);
}

constexpr int kGemmRows = 6;     // 6 x 2 accumulators + 2 weights + 1 broadcast = 15 ymm
constexpr int64_t kChunk = 128;  // k values per dequantised chunk: 128 x 16 (AVX-512: 32) fp32 = 8 (16) KB, in L1

template <int NT>
void gemm_rows(int64_t rows, const float* x, int64_t ldx, int64_t k0, int64_t kc, const float* buf, int64_t ldb,
               float* acc, int64_t ldo, bool first) {
  switch (rows) {
    case 1: return gemm_chunk<1, NT>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 2: return gemm_chunk<2, NT>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 3: return gemm_chunk<3, NT>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 4: return gemm_chunk<4, NT>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 5: return gemm_chunk<5, NT>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    default: return gemm_chunk<6, NT>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
  }
}

// The same micro-kernel on AVX-512 (where the CPU has it): one zmm is a tile pair's 16
// columns, two of them cover four tiles, and 8 rows x 2 accumulators fill half the 32
// registers. Each lane still adds one product per k, in k order: the same bits as above.
template <int MR>
__attribute__((target("avx512f"))) void gemm_chunk512(const float* x, int64_t ldx, int64_t k0, int64_t kc,
                                                        const float* buf, int64_t ldb, float* acc_out, int64_t ldo,
                                                        bool first) {
  __m512 acc[MR][2];
  if (first) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm512_loadu_ps(acc_out + r * ldo);
      acc[r][1] = _mm512_loadu_ps(acc_out + r * ldo + 16);
    }
  }
  const float* xk = x + k0;
  const float* bk = buf;
  for (int64_t kk = 0; kk < kc; ++kk, ++xk, bk += ldb) {
    const __m512 w0 = _mm512_loadu_ps(bk), w1 = _mm512_loadu_ps(bk + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(xk[r * ldx]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc_out + r * ldo, acc[r][0]);
    _mm512_storeu_ps(acc_out + r * ldo + 16, acc[r][1]);
  }
}

constexpr int kGemmRows512 = 8;

void gemm_rows512(int64_t rows, const float* x, int64_t ldx, int64_t k0, int64_t kc, const float* buf, int64_t ldb,
                  float* acc, int64_t ldo, bool first) {
  switch (rows) {
    case 1: return gemm_chunk512<1>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 2: return gemm_chunk512<2>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 3: return gemm_chunk512<3>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 4: return gemm_chunk512<4>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 5: return gemm_chunk512<5>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 6: return gemm_chunk512<6>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    case 7: return gemm_chunk512<7>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
    default: return gemm_chunk512<8>(x, ldx, k0, kc, buf, ldb, acc, ldo, first);
  }
}

// A group of kGroupTiles tiles through one micro-kernel call per (chunk, rows): AVX2 works
// on pairs (16 columns), AVX-512 on quads (32).
template <bool kAvx512>
struct Gemm {
  static constexpr int kGroupTiles = kAvx512 ? 4 : 2;
  static constexpr int64_t kRows = kAvx512 ? kGemmRows512 : kGemmRows;
  static constexpr int64_t kLdb = kGroupTiles * kTileCols;
  // x rows per pass over the weights: 96 x 1,536 fp32 is 576 KB (Intel's 1-2 MB L2), 48 x
  // 1,536 is 288 KB (Zen 3's 512 KB); multiples of both micro-kernels' row counts.
  static constexpr int64_t kRowBlock = kAvx512 ? 96 : 48;
  static void rows(int64_t rows, const float* x, int64_t ldx, int64_t k0, int64_t kc, const float* buf, float* acc,
                   int64_t ldo, bool first) {
    if constexpr (kAvx512)
      gemm_rows512(rows, x, ldx, k0, kc, buf, kLdb, acc, ldo, first);
    else
      gemm_rows<2>(rows, x, ldx, k0, kc, buf, kLdb, acc, ldo, first);
  }
};

// Rows from kInRegisterRows (AVX-512: kInRegisterRows512) up: tiles a group at a time, each chunk of K dequantised once into
// an L1 buffer and used by every row; partial sums wait in `out` (a float stored and
// reloaded is the same float, so the order stays k = 0, 1, ...). A group cut short by the
// end of the matrix (or its padded last tile) accumulates in a scratch tile whose
// zero-scale columns are computed and cut off.
template <bool kQ8, bool kAvx512>
void run_gemm(int64_t tile0, int64_t ntiles, int64_t m, const uint8_t* tiles, int64_t nb, const float* x, int64_t k,
              float* out, int64_t out_features, const float* bias) {
  using G = Gemm<kAvx512>;
  const int64_t stride = nb * (kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1));
  alignas(64) float buf[kChunk * G::kLdb];
  alignas(64) float acc[G::kRows * G::kLdb];
  // Rows a block at a time, so that a block of x stays in L2 while every group passes
  // over it (prefill chunks of hundreds of rows); each block dequantises the weights again.
  for (int64_t r0 = 0; r0 < m; r0 += G::kRowBlock) {
    const int64_t r1 = std::min(m, r0 + G::kRowBlock);
    for (int64_t g = tile0; g < tile0 + ntiles; g += G::kGroupTiles) {
      const int nt = static_cast<int>(std::min<int64_t>(G::kGroupTiles, tile0 + ntiles - g));
      const int64_t ncols = std::min(nt * kTileCols, out_features - g * kTileCols);
      const bool direct = ncols == G::kLdb;  // a whole group: accumulate straight into out
      if (!direct) std::memset(buf, 0, sizeof(buf));  // the missing tiles' columns stay 0
      for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, k - k0);
        dequant_chunk<kQ8>(tiles + g * stride, stride, nt, k0, kc, buf, G::kLdb);
        for (int64_t r = r0; r < r1; r += G::kRows) {
          const int64_t rows = std::min<int64_t>(G::kRows, r1 - r);
          float* o = out + r * out_features + g * kTileCols;
          if (direct) {
            G::rows(rows, x + r * k, k, k0, kc, buf, o, out_features, k0 == 0);
            continue;
          }
          for (int64_t i = 0; i < rows && k0 > 0; ++i)
            std::memcpy(acc + i * G::kLdb, o + i * out_features, ncols * sizeof(float));
          G::rows(rows, x + r * k, k, k0, kc, buf, acc, G::kLdb, k0 == 0);
          for (int64_t i = 0; i < rows; ++i) std::memcpy(o + i * out_features, acc + i * G::kLdb, ncols * sizeof(float));
        }
      }
      if (bias != nullptr) {
        for (int64_t r = r0; r < r1; ++r) {
          float* o = out + r * out_features + g * kTileCols;
          for (int64_t j = 0; j < ncols; ++j) o[j] += bias[g * kTileCols + j];
        }
      }
    }
  }
}

// Rows below kInRegisterRows (AVX-512: kInRegisterRows512): the weights dequantised in registers as they are used, four
// tiles at a time so that enough independent fma chains hide the fma latency at one row.
constexpr int64_t kInRegisterRows = 4;
// With AVX-512's 32 registers a four-tile group holds 5 rows' accumulators (10 zmm); at
// 4-5 rows that ran 1.3-2.7x the GEMM path, at 6 (spilling) slower than it.
constexpr int64_t kInRegisterRows512 = 6;

template <int NT, bool kQ8>
void rows_dq(int64_t rows, const uint8_t* tiles, int64_t group_stride, int64_t nb, const float* x, int64_t ldx,
             float* out, int64_t ldo, int64_t ncols_last, const float* bias) {
  switch (rows) {
    case 1: return dq_tile<1, NT, kQ8>(tiles, group_stride, nb, x, ldx, out, ldo, ncols_last, bias);
    case 2: return dq_tile<2, NT, kQ8>(tiles, group_stride, nb, x, ldx, out, ldo, ncols_last, bias);
    default: return dq_tile<3, NT, kQ8>(tiles, group_stride, nb, x, ldx, out, ldo, ncols_last, bias);
  }
}

// The in-register path on AVX-512 for a whole group of four tiles: one zmm holds two
// tiles' 16 columns, so each dequantising instruction does twice the work. Lanes and their
// k order are the ones above.
template <int S>
__attribute__((target("avx512f"))) inline __m512 q4_at512(__m512i raw, __m512i low4, __m512 d, __m512 m) {
  const __m512i q = S == 28 ? _mm512_srli_epi32(raw, 28) : _mm512_and_si512(_mm512_srli_epi32(raw, S), low4);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
}

template <int T>
__attribute__((target("avx512f"))) inline __m512 q8_at512(__m512i raw, __m512 d) {
  const __m512i q = _mm512_srai_epi32(T == 3 ? raw : _mm512_slli_epi32(raw, 24 - 8 * T), 24);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
}

template <int MR>
__attribute__((target("avx512f"))) inline void step512(const float* x, int64_t ldx, int64_t k, __m512 w0, __m512 w1,
                                                         __m512 (&acc)[MR][2]) {
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
    acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
  }
}

template <int MR, bool kQ8>
__attribute__((target("avx512f"))) void dq_quad512(const uint8_t* tiles, int64_t stride, int64_t nb, const float* x,
                                                     int64_t ldx, float* out, int64_t ldo, const float* bias) {
  const int64_t tb = kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1);
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  __m512 acc[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t0 = tiles + b * tb;
    const uint8_t *t1 = t0 + stride, *t2 = t1 + stride, *t3 = t2 + stride;
    const __m512 d0 = halves512(t0, t1), d1 = halves512(t2, t3);
    const int64_t k0 = b * kBlock;
    if constexpr (kQ8) {
      for (int c = 0; c < 8; ++c) {
        const int64_t off = 16 + 32 * c, k = k0 + 4 * c;
        const __m512i r0 = pair512(t0 + off, t1 + off), r1 = pair512(t2 + off, t3 + off);
        step512<MR>(x, ldx, k, q8_at512<0>(r0, d0), q8_at512<0>(r1, d1), acc);
        step512<MR>(x, ldx, k + 1, q8_at512<1>(r0, d0), q8_at512<1>(r1, d1), acc);
        step512<MR>(x, ldx, k + 2, q8_at512<2>(r0, d0), q8_at512<2>(r1, d1), acc);
        step512<MR>(x, ldx, k + 3, q8_at512<3>(r0, d0), q8_at512<3>(r1, d1), acc);
      }
    } else {
      const __m512 m0 = halves512(t0 + 16, t1 + 16), m1 = halves512(t2 + 16, t3 + 16);
      for (int v = 0; v < 4; ++v) {
        const int64_t off = 32 + 32 * v, k = k0 + 8 * v;
        const __m512i r0 = pair512(t0 + off, t1 + off), r1 = pair512(t2 + off, t3 + off);
#define PAGEDSERVE_Q4_STEP512(S, K_OFF) \
  step512<MR>(x, ldx, k + (K_OFF), q4_at512<S>(r0, low4, d0, m0), q4_at512<S>(r1, low4, d1, m1), acc);
        PAGEDSERVE_Q4_STEP512(0, 0)
        PAGEDSERVE_Q4_STEP512(8, 1)
        PAGEDSERVE_Q4_STEP512(16, 2)
        PAGEDSERVE_Q4_STEP512(24, 3)
        PAGEDSERVE_Q4_STEP512(4, 4)
        PAGEDSERVE_Q4_STEP512(12, 5)
        PAGEDSERVE_Q4_STEP512(20, 6)
        PAGEDSERVE_Q4_STEP512(28, 7)
#undef PAGEDSERVE_Q4_STEP512
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    store_row512(out + r * ldo, acc[r][0], acc[r][1], bias);
  }
}

template <bool kQ8>
void rows_quad512(int64_t rows, const uint8_t* tiles, int64_t stride, int64_t nb, const float* x, int64_t ldx,
                  float* out, int64_t ldo, const float* bias) {
  switch (rows) {
    case 1: return dq_quad512<1, kQ8>(tiles, stride, nb, x, ldx, out, ldo, bias);
    case 2: return dq_quad512<2, kQ8>(tiles, stride, nb, x, ldx, out, ldo, bias);
    case 3: return dq_quad512<3, kQ8>(tiles, stride, nb, x, ldx, out, ldo, bias);
    case 4: return dq_quad512<4, kQ8>(tiles, stride, nb, x, ldx, out, ldo, bias);
    default: return dq_quad512<5, kQ8>(tiles, stride, nb, x, ldx, out, ldo, bias);
  }
}

template <bool kQ8>
void run_in_registers(int64_t tile0, int64_t ntiles, int64_t m, const uint8_t* tiles, int64_t nb, const float* x,
                      int64_t k, float* out, int64_t out_features, const float* bias, bool avx512) {
  const int64_t stride = nb * (kQ8 ? tile_bytes(kQ8_0) : tile_bytes(kQ4_1));
  for (int64_t g = tile0; g < tile0 + ntiles;) {
    const int64_t nt = std::min<int64_t>(4, tile0 + ntiles - g);
    const int64_t ncols_last = std::min(kTileCols, out_features - (g + nt - 1) * kTileCols);
    const float* bias_g = bias ? bias + g * kTileCols : nullptr;
    const uint8_t* t0 = tiles + g * stride;
    float* o = out + g * kTileCols;
    if (avx512 && nt == 4 && ncols_last == kTileCols) {
      rows_quad512<kQ8>(m, t0, stride, nb, x, k, o, out_features, bias_g);
      g += nt;
      continue;
    }
    for (int64_t r = 0; r < m; r += 3) {  // the AVX2 tiles hold 3 rows' accumulators
      const int64_t rows = std::min<int64_t>(3, m - r);
      const float* xr = x + r * k;
      float* orow = o + r * out_features;
      switch (nt) {
        case 4: rows_dq<4, kQ8>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
        case 3: rows_dq<3, kQ8>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
        case 2: rows_dq<2, kQ8>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
        default: rows_dq<1, kQ8>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
      }
    }
    g += nt;
  }
}

at::Tensor dequant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features,
                          const std::optional<at::Tensor>& bias) {
  auto [in, out, bias_padded, k, nb, ng, m] = check_tiled_linear("dequant_linear", x, packed, qtype, out_features, bias);
  if (m == 0) return out;
  const float* src = in.data_ptr<float>();
  const uint8_t* tiles = packed.data_ptr<uint8_t>();
  const float* bias_ptr = bias.has_value() ? bias_padded.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  // Tiles are split across threads in groups of four; each task's weights stay in L1/L2
  // while it walks the rows (four Q4 tiles over K = 1,536 are 30 KB).
  const int64_t groups = (ng + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, m * k * 4 * kTileCols));
  const bool avx512 = use_avx512(), in_registers = m < (avx512 ? kInRegisterRows512 : kInRegisterRows);
  mark_isa_path(avx512 ? IsaPath::kDequantLinearAvx512 : IsaPath::kDequantLinearAvx2);
  at::parallel_for(0, groups, grain, [&](int64_t p0, int64_t p1) {
    const int64_t t0 = 4 * p0, nt = std::min(4 * p1, ng) - t0;
    if (qtype == kQ8_0) {
      if (in_registers) run_in_registers<true>(t0, nt, m, tiles, nb, src, k, dst, out_features, bias_ptr, avx512);
      else if (avx512) run_gemm<true, true>(t0, nt, m, tiles, nb, src, k, dst, out_features, bias_ptr);
      else run_gemm<true, false>(t0, nt, m, tiles, nb, src, k, dst, out_features, bias_ptr);
    } else {
      if (in_registers) run_in_registers<false>(t0, nt, m, tiles, nb, src, k, dst, out_features, bias_ptr, avx512);
      else if (avx512) run_gemm<false, true>(t0, nt, m, tiles, nb, src, k, dst, out_features, bias_ptr);
      else run_gemm<false, false>(t0, nt, m, tiles, nb, src, k, dst, out_features, bias_ptr);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("dequant_linear(Tensor x, Tensor packed, int qtype, int out_features, Tensor? bias) -> Tensor", &dequant_linear);
}

}  // namespace pagedserve::quant
