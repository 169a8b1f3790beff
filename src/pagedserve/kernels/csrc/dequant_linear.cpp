// y = x W^T + b in fp32, W read from the packed tiles of quant_repack (quant_linear.h) and
// dequantised in registers: the fp32 model a GGUF file defines, at about the file's bytes
// per weight. Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL, IQ4_XS, MXFP4, and F16 / BF16 weights
// as stored (a bf16 Hugging Face checkpoint's fp32 model at half its fp32 bytes).
//
// Why: a GGUF's fp32 model is its blocks dequantised, so an fp32 layer built from the file
// holds nothing the blocks do not; reading the blocks instead of the inflated fp32 matrix
// moves 0.14-0.27x of the bytes, and batch-1 decode is bound by those bytes. The
// activations stay fp32, so the arithmetic is the fp32 model's: each weight is
// fma(code, d, m) with d and m exact fp32 numbers (d * code is exact: at most 24
// significant bits), the value the loader's dequantisation gives, rounded once.
//
// Order: lane j of an accumulator is output column j, and each lane adds x[k] * w[k] for k =
// 0, 1, ..., K-1, one fma per k. Row and column tiling, thread count and vector width change
// which lanes are computed together, never the order within a lane, so a row's outputs are
// the same bits whatever batch it is in (and what the reference in tests computes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "isa.h"
#include "quant_linear.h"
#include "tiles512.h"
#include "tile_vectors.h"
#include "vec.h"

namespace pagedserve::quant {
namespace {

namespace avx2 {
#include "dequant_tiles.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
#include "dequant_tiles.inc"
}  // namespace avx512
#pragma GCC pop_options

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

// Rows from kInRegisterRows (AVX-512: kInRegisterRows512) up: tiles a group at a time, each
// chunk of K dequantised once into an L1 buffer and used by every row; partial sums wait in
// `out` (a float stored and reloaded is the same float, so the order stays k = 0, 1, ...).
// A group cut short by the end of the matrix (or its padded last tile) accumulates in a
// scratch tile whose zero-scale columns are computed and cut off.
template <int64_t kType, bool kAvx512>
void run_gemm(int64_t tile0, int64_t ntiles, int64_t m, const uint8_t* tiles, int64_t stride, const float* x,
              int64_t k, float* out, int64_t out_features, const float* bias) {
  using G = Gemm<kAvx512>;
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
        avx2::dequant_chunk<V8, kType>(tiles + g * stride, stride, nt, k0, kc, buf, G::kLdb);
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

// Rows below kInRegisterRows (AVX-512: kInRegisterRows512): the weights dequantised in
// registers as they are used, four tiles at a time so that enough independent fma chains
// hide the fma latency at one row.
constexpr int64_t kInRegisterRows = 4;
// With AVX-512's 32 registers a four-tile group holds 5 rows' accumulators (10 zmm); at
// 4-5 rows that ran 1.3-2.7x the GEMM path, at 6 (spilling) slower than it.
constexpr int64_t kInRegisterRows512 = 6;

template <int64_t kType, int NT>
void rows_avx2(int64_t rows, const uint8_t* tiles, int64_t stride, int64_t nb, const float* x, int64_t ldx,
               float* out, int64_t ldo, int64_t ncols_last, const float* bias) {
  switch (rows) {
    case 1: return avx2::dq_regs<V8, kType, 1, NT>(tiles, stride, nb, x, ldx, out, ldo, ncols_last, bias);
    case 2: return avx2::dq_regs<V8, kType, 2, NT>(tiles, stride, nb, x, ldx, out, ldo, ncols_last, bias);
    default: return avx2::dq_regs<V8, kType, 3, NT>(tiles, stride, nb, x, ldx, out, ldo, ncols_last, bias);
  }
}

template <int64_t kType>
void rows_avx512(int64_t rows, const uint8_t* tiles, int64_t stride, int64_t nb, const float* x, int64_t ldx,
                 float* out, int64_t ldo, const float* bias) {
  switch (rows) {
    case 1: return avx512::dq_regs<V16, kType, 1, 2>(tiles, stride, nb, x, ldx, out, ldo, 16, bias);
    case 2: return avx512::dq_regs<V16, kType, 2, 2>(tiles, stride, nb, x, ldx, out, ldo, 16, bias);
    case 3: return avx512::dq_regs<V16, kType, 3, 2>(tiles, stride, nb, x, ldx, out, ldo, 16, bias);
    case 4: return avx512::dq_regs<V16, kType, 4, 2>(tiles, stride, nb, x, ldx, out, ldo, 16, bias);
    default: return avx512::dq_regs<V16, kType, 5, 2>(tiles, stride, nb, x, ldx, out, ldo, 16, bias);
  }
}

template <int64_t kType>
void run_in_registers(int64_t tile0, int64_t ntiles, int64_t m, const uint8_t* tiles, int64_t stride, int64_t nb,
                      const float* x, int64_t k, float* out, int64_t out_features, const float* bias, bool avx512) {
  for (int64_t g = tile0; g < tile0 + ntiles;) {
    const int64_t nt = std::min<int64_t>(4, tile0 + ntiles - g);
    const int64_t ncols_last = std::min(kTileCols, out_features - (g + nt - 1) * kTileCols);
    const float* bias_g = bias ? bias + g * kTileCols : nullptr;
    const uint8_t* t0 = tiles + g * stride;
    float* o = out + g * kTileCols;
    if (avx512 && nt == 4 && ncols_last == kTileCols) {  // a whole group of four tiles
      rows_avx512<kType>(m, t0, stride, nb, x, k, o, out_features, bias_g);
      g += nt;
      continue;
    }
    for (int64_t r = 0; r < m; r += 3) {  // the AVX2 tiles hold 3 rows' accumulators
      const int64_t rows = std::min<int64_t>(3, m - r);
      const float* xr = x + r * k;
      float* orow = o + r * out_features;
      switch (nt) {
        case 4: rows_avx2<kType, 4>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
        case 3: rows_avx2<kType, 3>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
        case 2: rows_avx2<kType, 2>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
        default: rows_avx2<kType, 1>(rows, t0, stride, nb, xr, k, orow, out_features, ncols_last, bias_g); break;
      }
    }
    g += nt;
  }
}

template <int64_t kType>
void run(int64_t t0, int64_t nt, int64_t m, const uint8_t* tiles, int64_t stride, int64_t nb, const float* x,
         int64_t k, float* out, int64_t out_features, const float* bias, bool avx512) {
  if (m < (avx512 ? kInRegisterRows512 : kInRegisterRows))
    run_in_registers<kType>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
  else if (avx512)
    run_gemm<kType, true>(t0, nt, m, tiles, stride, x, k, out, out_features, bias);
  else
    run_gemm<kType, false>(t0, nt, m, tiles, stride, x, k, out, out_features, bias);
}

at::Tensor dequant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features,
                          const std::optional<at::Tensor>& bias) {
  auto [in, out, bias_padded, k, nb, ng, m] = check_tiled_linear("dequant_linear", x, packed, qtype, out_features, bias);
  if (m == 0) return out;
  const float* src = in.data_ptr<float>();
  const uint8_t* tiles = packed.data_ptr<uint8_t>();
  const float* bias_ptr = bias.has_value() ? bias_padded.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  const int64_t stride = packed.size(1) * packed.size(2);  // bytes from one tile's weights to the next's
  // Tiles are split across threads in groups of four; each task's weights stay in L1/L2
  // while it walks the rows (four Q4 tiles over K = 1,536 are 30 KB).
  const int64_t groups = (ng + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, m * k * 4 * kTileCols));
  const bool avx512 = use_avx512();
  mark_isa_path(avx512 ? IsaPath::kDequantLinearAvx512 : IsaPath::kDequantLinearAvx2);
  at::parallel_for(0, groups, grain, [&](int64_t p0, int64_t p1) {
    const int64_t t0 = 4 * p0, nt = std::min(4 * p1, ng) - t0;
    dequant_tiles(qtype, t0, nt, m, tiles, stride, nb, src, k, dst, out_features, bias_ptr, avx512);
  });
  return out;
}

}  // namespace

void dequant_tiles(int64_t qtype, int64_t t0, int64_t nt, int64_t m, const uint8_t* tiles, int64_t stride, int64_t nb,
                   const float* x, int64_t k, float* out, int64_t out_features, const float* bias, bool avx512) {
  switch (qtype) {
    case kQ8_0: return run<kQ8_0>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ4_0:  // Q4_0's tiles are Q4_1's (m = -8d)
    case kQ4_1: return run<kQ4_1>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ5_0:  // likewise with m = -16d
    case kQ5_1: return run<kQ5_1>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ2_K: return run<kQ2_K>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ3_K: return run<kQ3_K>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ4_K: return run<kQ4_K>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ5_K: return run<kQ5_K>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kQ6_K: return run<kQ6_K>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kIQ4_NL: return run<kIQ4_NL>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kIQ4_XS: return run<kIQ4_XS>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kMXFP4: return run<kMXFP4>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kF16: return run<kF16>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
    case kBF16: return run<kBF16>(t0, nt, m, tiles, stride, nb, x, k, out, out_features, bias, avx512);
  }
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("dequant_linear(Tensor x, Tensor packed, int qtype, int out_features, Tensor? bias) -> Tensor", &dequant_linear);
}

}  // namespace pagedserve::quant
