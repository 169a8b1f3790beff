// Paged attention for every query of a step (decodes, speculative verification rows,
// prefill chunks) that reads K and V in place through the block table.
//
// Why not torch: CpuPagedAttention gathers every short query's blocks into a padded
// tensor before SDPA; at a 32-row decode step that copy was ~24% of the step and the
// attention over it ~27% (torch.profiler on that step). Here each work item is (sequence, one partition
// of 256 key positions): it walks the partition's blocks, and each KV head's K/V rows
// of a block are read from memory once for all the query rows that share them (the
// query tokens x the query heads of that KV head, GQA). The softmax runs once per
// partition in two passes (every row's scores, then the values), not online per block:
// per-block max/exp/rescale bookkeeping cost as much as the dot products themselves,
// and the two-pass form measured 1.26x faster at 32 decodes x 512 context (fp32, 30
// layers' caches, 2 threads; 1.4x with an fp16 cache), near the VM's read bandwidth.
// A longer sequence is several items whose partial results (unnormalised output, max,
// sum) the last one to finish merges, in partition order: one long sequence uses every
// core, and since partitions sit at fixed positions, a row's arithmetic depends only
// on its own sequence, never on what else is in the batch or how its prompt was chunked.
// A long query is cut into tiles of at most kTileRows rows (its tokens x query heads), each
// tile its own items over only the partitions its last token can see: every tile's scores
// stay in L2, and the causal half of a prompt's work is skipped. A row's arithmetic is the
// same in any tile (a partition it cannot see adds nothing to the merge), so tiling keeps
// the bits too. At 2,048 query tokens x 2,048 keys (SmolLM2's heads, 2 threads, AMD EPYC
// Zen 5) the untiled op took 2.0x the time of torch's flash attention; tiled, 0.76x, and
// 0.33-0.84x on the prefill chunks of benchmarks/kernels.py --section attention.
// Where the CPU has AVX-512VL, a KV head's query rows go three at a time through each
// K and V vector (its 32 registers hold three rows' accumulators), the same per-lane
// arithmetic as one at a time, so both paths give the same bits. There the values, the
// softmax's exponentials and (from kTransposeRows rows per KV head: prefill chunks) the
// scores run 16 lanes wide, the scores from keys transposed once per block with the AVX2
// path's summation tree written out: one 2,048-token prompt's attention (SmolLM2's heads,
// 2 threads, AMD EPYC Zen 5) took 0.71-0.77x the time of the 8-lane form with an fp32
// cache and 0.78-0.82x with fp16, the same bits.
// A cache of fp16 or fp8 elements (`--kv-cache-dtype`) is read in its own width: widened
// in registers as it is read when a KV head has at most kWidenRows query rows (a decode
// at GQA <= 3), otherwise converted to fp32 once per block and head, into a buffer that
// stays in L1 while every query row of that head uses it. Widened so, an fp16 cache took
// 0.58-0.64x the time of fp32 at 64 decodes x 320 context (30 layers' caches, 2 threads,
// AVX-512 path), where the buffer had left it at 0.76-0.84x.
// Two options serve Gemma 2/3 and Phi-3 (model/gemma.py): `window` > 0 masks every key more
// than window - 1 positions before a row's token (sliding-window layers: the K/V stay in the
// cache, the window only masks), and partitions wholly before a tile's first window are not
// visited (they would add nothing to the merge, so the bits are the same); `softcap` > 0
// caps every score as softcap * tanh(score / softcap) before the softmax (Gemma 2). Both act
// on a row's scores in one function that the AVX2 and AVX-512 paths share, so the two paths
// still give the same bits.
// `sinks` (gpt-oss): one learned logit per query head that joins every row's softmax
// denominator and carries no value. It enters once, where a row's merged max and sum are
// turned into its output (write_rows), so no partition counts it twice, and the AVX2 and
// AVX-512 paths, which share that scalar code, give the same bits with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "kv_types.h"
#include "vec.h"

namespace pagedserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys per partition (rounded up to whole blocks): long enough that a merge costs
// little beside it, short enough that every row's scores for it stay in L1/L2.
constexpr int64_t kPartitionKeys = 256;
constexpr int64_t kMaxBlockSize = 256;
// Rows (query tokens x query heads) per work item at most: their scores for one partition,
// kTileRows x (kPartitionKeys + 8) floats, take 270 KB, inside every target's L2.
constexpr int64_t kTileRows = 256;
// Up to this many query rows per KV head, a narrow cache is widened in registers on each
// row group's read rather than once into a buffer: on the AVX2 path (one row per group, so
// three widenings of each vector) 64 fp16 decodes x 320 keys took 0.96-1.00 ms a layer
// against 1.02-1.18 through the buffer, alternated three times.
constexpr int64_t kWidenRows = 3;
// From this many query rows per KV head on the AVX-512 path, a block's keys are transposed
// once ([head_dim][16 keys]) so that each row's scores for 16 keys are 16-lane FMAs with no
// horizontal sums: prefill chunks, and decodes of models with GQA >= 8. Not tuned: SmolLM2's
// decodes (3 rows) keep the in-place path and measured unchanged; the bits are the same
// either side of it.
constexpr int64_t kTransposeRows = 8;


inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// [sum(a0), ..., sum(a7)]: eight dot products' accumulators reduced into one vector.
inline __m256 transpose_sum(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // lanes: a0..a3 low halves | a0..a3 high halves
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

struct Problem {
  const float* q;
  int64_t q_token_stride, q_head_stride;
  const void* k_cache;  // elements of the cache's type (kv_types.h)
  const void* v_cache;
  int64_t block_stride, token_stride;  // within one plane of the cache, in elements
  int64_t element_bytes;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* query_start;
  const int64_t* seq_lens;
  int64_t block_size, num_kv_heads, group, head_dim;
  float scale;
  float* out;
  int64_t out_token_stride;
  int64_t partition_keys;  // a multiple of block_size
  int64_t window;          // sliding window in keys (a row's own included); 0: none
  float softcap;           // attention logit soft-capping; 0: none
  const float* sinks;      // [num_heads] logits with no value in every row's softmax; nullptr: none
};

// Query tokens token_begin .. token_begin + tokens - 1 of a sequence's new tokens.
struct Tile {
  int64_t seq, token_begin, tokens;
};

struct Item {
  Tile tile;
  int64_t key_begin, key_end;
  int64_t group_index;  // index of the tile's split group; -1 when unsplit
  int64_t partial;      // offset of this item's partial result in the partials buffer
  int64_t cost;
};

struct SplitGroup {
  Tile tile;
  int64_t first_partial, num_parts, rows;
};

// Eight elements of a cache row as fp32 (the stored values, whatever the load's own scale).
template <typename S>
[[gnu::always_inline]] inline __m256 load_fp32(const S* src) {
  __m256 x = KVType<S>::load8(src);
  if constexpr (KVType<S>::kLoadFactor != 1.0f) x = _mm256_mul_ps(x, _mm256_set1_ps(1.0f / KVType<S>::kLoadFactor));
  return x;
}

// Scores (already scaled) of R query rows of one KV head against a block's keys, each row
// up to its own count: whole 8-key tiles up to the longest count (never past the block;
// lanes past a row's count are overwritten by its caller), then single keys. Each K
// vector is loaded (and widened, for a narrow cache) once for all R rows; per lane the
// arithmetic is the same for every R, so the R=3 path built for 32 ymm registers
// (AVX-512VL) gives the R=1 path's bits.
template <int NV, int R, typename S>
[[gnu::always_inline]] inline void group_scores(const float* q, int64_t d, const S* keys, int64_t token_stride,
                                                const int64_t* count, int64_t block_size, float* const* scores) {
  const int64_t nv = NV ? NV : d / 8;
  int64_t longest = 0;
  for (int r = 0; r < R; ++r) longest = std::max(longest, count[r]);
  int64_t t = 0;
  for (; t < longest && t + 8 <= block_size; t += 8) {
    __m256 acc[R][8];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 8; ++j) acc[r][j] = _mm256_setzero_ps();
    if constexpr (R == 1 && NV != 0) {
      // One row: its query in registers, the keys as memory operands.
      __m256 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm256_loadu_ps(q + 8 * v);
      for (int v = 0; v < NV; ++v)
        for (int j = 0; j < 8; ++j)
          acc[0][j] = _mm256_fmadd_ps(qv[v], load_fp32<S>(keys + (t + j) * token_stride + 8 * v), acc[0][j]);
    } else {
      for (int64_t v = 0; v < nv; ++v)
        for (int j = 0; j < 8; ++j) {
          const __m256 k = load_fp32<S>(keys + (t + j) * token_stride + 8 * v);
          for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + 8 * v), k, acc[r][j]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(scores[r] + t, transpose_sum(acc[r]));
  }
  for (int r = 0; r < R; ++r)
    for (int64_t k = t; k < count[r]; ++k) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t v = 0; v < nv; ++v)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + 8 * v), load_fp32<S>(keys + k * token_stride + 8 * v), acc);
      scores[r][k] = hsum(acc);
    }
}

// Sixteen elements of a cache row as fp32.
#pragma GCC push_options
#pragma GCC target("avx512f")
template <typename S>
inline __m512 load16_fp32(const S* src) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(src);
  } else {
    const __m256d lo = _mm256_castps_pd(load_fp32<S>(src)), hi = _mm256_castps_pd(load_fp32<S>(src + 8));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
  }
}
#pragma GCC pop_options

// Eight (V8) or sixteen (V16) elements of a cache row as fp32.
template <class L, typename S>
[[gnu::always_inline]] inline typename L::F load_lanes(const S* src) {
  if constexpr (L::kCols == 8) {
    return load_fp32<S>(src);
  } else {
    return load16_fp32<S>(src);
  }
}

// Keeps v in a register: else the compiler folds its load into each row's FMA, and the
// loads (one per row) bound the loop instead of the FMAs.
template <typename F>
[[gnu::always_inline]] inline void in_register(F& v) {
  asm("" : "+v"(v));
}

// acc_r += sum_t p_r[t] * values[t] for R rows and t < count: each V vector is loaded
// (and widened) once for all R rows. Keys past a row's own count have p = 0 exactly
// (their scores were -inf), so adding them leaves its sums as they were. Each output
// lane is one chain of FMAs over t whatever the width L, so V8 and V16 give the same bits.
template <class L, int NV, int R, typename S>
[[gnu::always_inline]] inline void group_values(float* const* acc, const float* const* p, const S* values,
                                                int64_t token_stride, int64_t count, int64_t d) {
  using F = typename L::F;
  // 64 values of every row at a time: 24 ymm or 12 zmm accumulators at R=3.
  constexpr int kChunk = NV == 0 ? 1 : std::min(NV * 8, 64) / L::kCols;
  constexpr int kStep = L::kCols * kChunk;
  for (int64_t c = 0; c < d; c += kStep) {
    F a[R][kChunk];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kChunk; ++v) a[r][v] = L::load(acc[r] + c + L::kCols * v);
    for (int64_t t = 0; t < count; ++t) {
      F pt[R];
      for (int r = 0; r < R; ++r) pt[r] = L::set1(p[r][t]);
      const S* row = values + t * token_stride + c;
      for (int v = 0; v < kChunk; ++v) {
        F x = load_lanes<L, S>(row + L::kCols * v);
        in_register(x);
        for (int r = 0; r < R; ++r) a[r][v] = L::fmadd(pt[r], x, a[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kChunk; ++v) L::store(acc[r] + c + L::kCols * v, a[r][v]);
  }
}

// The functions below are not inlined: they run only where the CPU has AVX-512, and
// the lambdas of attend_rows that call them may be compiled for AVX2.
// A block's first `count` rows of one head (a multiple of 16, fp32, stride token_stride)
// as [keys / 16][d][16]: each dimension of 16 keys in one zmm. 8 x 8 tiles through registers.
__attribute__((target("avx512f,avx512vl"))) void transpose_keys(const float* keys, int64_t token_stride,
                                                                       int64_t count, int64_t d, float* kt) {
  for (int64_t t = 0; t < count; t += 8)
    for (int64_t i = 0; i < d; i += 8) {
      __m256 r[8], u[8], w[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(keys + (t + j) * token_stride + i);
      for (int j = 0; j < 8; j += 2) {
        u[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        u[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int j = 0; j < 8; j += 4) {
        w[j] = _mm256_shuffle_ps(u[j], u[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        w[j + 1] = _mm256_shuffle_ps(u[j], u[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        w[j + 2] = _mm256_shuffle_ps(u[j + 1], u[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
        w[j + 3] = _mm256_shuffle_ps(u[j + 1], u[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      float* dst = kt + (t / 16) * d * 16 + i * 16 + t % 16;
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(dst + j * 16, _mm256_permute2f128_ps(w[j], w[j + 4], 0x20));
        _mm256_storeu_ps(dst + (j + 4) * 16, _mm256_permute2f128_ps(w[j], w[j + 4], 0x31));
      }
    }
}

// group_scores' numbers from transposed keys (transpose_keys), 16 keys per chunk up to
// `longest`: lane l of group_scores' accumulator is P_l here, the same FMA chain over the
// head's vectors, and transpose_sum's tree ((P0+P1)+(P2+P3)) + ((P4+P5)+(P6+P7)) is
// written out, so every score has the same bits as on the AVX2 path.
template <int R>
__attribute__((target("avx512f,avx512vl"))) void transposed_scores(
    const float* q, int64_t d, const float* kt, int64_t longest, float* const* scores) {
  for (int64_t t = 0; t < longest; t += 16) {
    const float* chunk = kt + (t / 16) * d * 16;
    __m512 part[R][8];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 8; ++l) part[r][l] = _mm512_setzero_ps();
    for (int64_t v = 0; v < d; v += 8)
      for (int l = 0; l < 8; ++l) {
        __m512 k = _mm512_loadu_ps(chunk + (v + l) * 16);
        in_register(k);
        for (int r = 0; r < R; ++r) part[r][l] = _mm512_fmadd_ps(k, _mm512_set1_ps(q[r * d + v + l]), part[r][l]);
      }
    for (int r = 0; r < R; ++r) {
      const __m512 lo = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]), _mm512_add_ps(part[r][2], part[r][3]));
      const __m512 hi = _mm512_add_ps(_mm512_add_ps(part[r][4], part[r][5]), _mm512_add_ps(part[r][6], part[r][7]));
      _mm512_storeu_ps(scores[r] + t, _mm512_add_ps(lo, hi));
    }
  }
}

// group_values on 16 lanes where head_dim is whole zmm vectors.
template <int NV, int R, typename S>
__attribute__((target("avx512f,avx512vl"))) void wide_values(float* const* acc, const float* const* p, const S* values,
                                                            int64_t token_stride, int64_t count, int64_t d) {
  if constexpr (NV == 0 || NV % 2 != 0) {
    group_values<quant::V8, NV, R>(acc, p, values, token_stride, count, d);
  } else {
    group_values<quant::V16, NV, R>(acc, p, values, token_stride, count, d);
  }
}

// A row's softmax numerators exp(s - m) in place over scores t .. n - 1 (n - t a multiple
// of 8), added to vsum in 8 lanes in order (t, t + 8, ...).
[[gnu::always_inline]] inline __m256 exp_in_place(float* s, int64_t t, int64_t n, float m, __m256 vsum) {
  const __m256 vm = _mm256_set1_ps(m);
  for (; t < n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return vsum;
}

// exp_in_place over n scores, 16 lanes at a time, each vector's two halves added to the
// 8-lane sum one after the other: the same bits.
__attribute__((target("avx512f,avx512vl"))) __m256 exp_in_place_wide(float* s, int64_t n, float m) {
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp_lanes<quant::V16>(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  return exp_in_place(s, t, n, m, vsum);
}

// Blocks sit at random places in the pool, so the hardware prefetcher cannot see the
// next one coming: fetch KV head kv's first `count` token rows of a block ahead of use.
// One head at a time, just before that head's work, spreads the fetches between the
// dot products; a whole block's worth in one burst stalled on the fill buffers (in the
// measurement above, alternated: fp16 1.26-1.54 -> 1.11-1.13 ms per layer, fp32
// 1.88-2.22 -> 1.63-1.90).
template <int Hint>
inline void prefetch_head(const Problem& p, const void* plane, int64_t block, int64_t kv, int64_t count) {
  const int64_t row_bytes = p.head_dim * p.element_bytes, stride = p.token_stride * p.element_bytes;
  const char* base = static_cast<const char*>(plane) + (block * p.block_stride + kv * p.head_dim) * p.element_bytes;
  for (int64_t t = 0; t < count; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(base + t * stride + b, static_cast<_mm_hint>(Hint));
}

// The query row r of a sequence with query_len qlen: rows are ordered (KV head, query
// token, query head within the KV head's group) so that each KV head's rows are contiguous.
struct RowIndex {
  int64_t token, head;
};
inline RowIndex row_index(int64_t r, int64_t qlen, int64_t g) {
  const int64_t per_kv = qlen * g, kv = r / per_kv, within = r % per_kv;
  return {within / g, kv * g + within % g};
}

// count rows of head_dim values (stride token_stride) as fp32, packed at dst (stride d).
template <typename T>
void convert_rows(const T* src, int64_t token_stride, int64_t count, int64_t d, float* dst) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + t * d + i, load_fp32(src + t * token_stride + i));
}

// f(std::integral_constant<int, m>) for a runtime m in [1, M].
template <int M, typename F>
[[gnu::always_inline]] inline void with_rows(int64_t m, F&& f) {
  if constexpr (M > 1) {
    if (m < M) return with_rows<M - 1>(m, f);
  }
  f(std::integral_constant<int, M>{});
}

// The first key a row at position pos may see.
inline int64_t window_start(const Problem& p, int64_t pos) {
  return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
}

// One row's n scores (n a multiple of 8; -inf marks a key the row may not see): soft-capped
// as softcap * tanh(score / softcap), tanh(y) = sign(y) (1 - 2 / (exp(2|y|) + 1)), and the
// keys before the row's window start (first_visible, relative to the row's scores) masked.
// Not inlined: the AVX2 and AVX-512 paths run this very code, so their bits agree.
[[gnu::noinline]] void mask_and_cap(float* s, int64_t n, float softcap, int64_t first_visible) {
  if (softcap > 0.0f) {
    const __m256 cap = _mm256_set1_ps(softcap), neg_inf = _mm256_set1_ps(kNegInf), one = _mm256_set1_ps(1.0f);
    const __m256 two = _mm256_set1_ps(2.0f), sign_bit = _mm256_set1_ps(-0.0f);
    for (int64_t t = 0; t < n; t += 8) {
      const __m256 x = _mm256_loadu_ps(s + t);
      const __m256 y = _mm256_div_ps(x, cap);
      const __m256 e = exp256(_mm256_mul_ps(two, _mm256_andnot_ps(sign_bit, y)));
      const __m256 mag = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
      const __m256 capped = _mm256_mul_ps(_mm256_or_ps(mag, _mm256_and_ps(sign_bit, y)), cap);
      _mm256_storeu_ps(s + t, _mm256_blendv_ps(capped, x, _mm256_cmp_ps(x, neg_inf, _CMP_EQ_OQ)));
    }
  }
  std::fill(s, s + std::min(n, std::max<int64_t>(0, first_visible)), kNegInf);
}

// Softmax attention of one tile of a sequence's query tokens over keys [key_begin,
// key_end) (one partition), every KV head: leaves the unnormalised output in acc [rows][head_dim], the max and
// sum per row. A first pass over the partition's blocks writes every row's scores, one
// max/exp per row follows, then a second pass accumulates V. Each pass walks the
// blocks in order, so each block's K (then V) rows are read from memory once for all
// the query rows of the sequence, and from L1 once per group of RB rows of a KV head.
// A narrow cache is widened as it is read when a KV head has at most kWidenRows rows;
// otherwise each block's rows of a head are widened once into kvbuf for every group.
// scores holds rows x (partition_keys + 8) floats.
//
// Over 80 lines because a split of its passes into inlined helpers over a shared struct
// made GCC 12 drop every prefetch_head of the op (no prefetch instruction left in the
// object), the bits unchanged: kept whole until a split keeps them.
template <int NV, typename T, int RB, bool Wide>
[[gnu::always_inline]] inline void attend_rows(const Problem& p, const Tile& tile, int64_t key_begin,
                                               int64_t key_end, float* acc, float* row_max, float* row_sum, float* qbuf, float* kvbuf,
                                               float* scores) {
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size;
  const int64_t seq = tile.seq, start = p.query_start[seq] + tile.token_begin, qlen = tile.tokens;
  const int64_t per_kv = qlen * g, rows = per_kv * p.num_kv_heads;
  const int64_t first_pos = p.seq_lens[seq] - (p.query_start[seq + 1] - p.query_start[seq]) + tile.token_begin;
  const int64_t sstride = p.partition_keys + 8, span = key_end - key_begin;
  for (int64_t r = 0; r < rows; ++r) {
    const RowIndex ri = row_index(r, qlen, g);
    const float* src = p.q + (start + ri.token) * p.q_token_stride + ri.head * p.q_head_stride;
    for (int64_t i = 0; i < d; ++i) qbuf[r * d + i] = src[i] * p.scale;
    std::fill_n(acc + r * d, d, 0.0f);
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
  }
  const int64_t* table = p.tables + seq * p.table_stride;
  // f(rows, stride) with the block's first `count` rows of KV head kv: in place, or
  // widened into kvbuf when more than kWidenRows rows will read them.
  auto with_head_rows = [&](const void* plane, int64_t block, int64_t kv, int64_t count, auto&& f) {
    const T* base = static_cast<const T*>(plane) + block * p.block_stride + kv * d;
    if constexpr (!std::is_same_v<T, float>) {
      if (per_kv > kWidenRows) {
        convert_rows(base, p.token_stride, count, d, kvbuf);
        return f(static_cast<const float*>(kvbuf), d);
      }
    }
    f(base, p.token_stride);
  };
  // Keys of this block that query row r may see (causal within the new tokens).
  auto visible = [&](int64_t r, int64_t b0, int64_t n) {
    const int64_t token = (r % per_kv) / g;
    return std::max<int64_t>(0, std::min(n, first_pos + token - b0 + 1));
  };
  // f(std::integral_constant<int, R>, first row) for KV head kv's rows in groups of up to RB.
  auto for_groups = [&](int64_t kv, auto&& f) {
    for (int64_t r0 = kv * per_kv, end = r0 + per_kv; r0 < end; r0 += RB)
      with_rows<RB>(end - r0, [&](auto R) { f(R, r0); });
  };

  for (int64_t b0 = key_begin; b0 < key_end; b0 += bs) {
    const int64_t block = table[b0 / bs], n = std::min(bs, key_end - b0);
    for (int64_t kv = 0; kv < p.num_kv_heads; ++kv) {
      if (b0 + bs < key_end) prefetch_head<_MM_HINT_T0>(p, p.k_cache, table[b0 / bs + 1], kv, std::min(bs, key_end - b0 - bs));
      prefetch_head<_MM_HINT_T1>(p, p.v_cache, block, kv, n);  // for the second pass
      // Whole block: the 8-key tiles read up to the block's end.
      with_head_rows(p.k_cache, block, kv, bs, [&](const auto* keys, int64_t stride) {
        if constexpr (Wide && std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>, float>) {
          if (per_kv >= kTransposeRows && bs % 16 == 0) {
            const int64_t longest = (visible((kv + 1) * per_kv - 1, b0, n) + 15) & ~int64_t{15};
            float* kt = kvbuf + bs * d;
            transpose_keys(keys, stride, longest, d, kt);
            for_groups(kv, [&](auto R, int64_t r0) {
              float* s[R];
              for (int r = 0; r < R; ++r) s[r] = scores + (r0 + r) * sstride + (b0 - key_begin);
              transposed_scores<R>(qbuf + r0 * d, d, kt, longest, s);
              for (int r = 0; r < R; ++r) std::fill(s[r] + visible(r0 + r, b0, n), s[r] + n, kNegInf);
            });
            return;
          }
        }
        for_groups(kv, [&](auto R, int64_t r0) {
          int64_t count[R];
          float* s[R];
          for (int r = 0; r < R; ++r) {
            count[r] = visible(r0 + r, b0, n);
            s[r] = scores + (r0 + r) * sstride + (b0 - key_begin);
          }
          group_scores<NV, R>(qbuf + r0 * d, d, keys, stride, count, bs, s);
          for (int r = 0; r < R; ++r) std::fill(s[r] + count[r], s[r] + n, kNegInf);
        });
      });
    }
  }
  const int64_t padded = (span + 7) & ~int64_t{7};
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * sstride;
    std::fill(s + span, s + padded, kNegInf);
    if (p.softcap > 0.0f || p.window > 0) {
      const int64_t pos = first_pos + (r % per_kv) / g;
      mask_and_cap(s, padded, p.softcap, window_start(p, pos) - key_begin);
    }
    __m256 vmax = _mm256_set1_ps(kNegInf);
    for (int64_t t = 0; t < padded; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    const float m = hmax(vmax);
    if (m == kNegInf) {  // every key of the partition is after this row's token: no weight on any
      std::fill(s, s + padded, 0.0f);
      continue;
    }
    __m256 vsum;
    if constexpr (Wide) {
      vsum = exp_in_place_wide(s, padded, m);
    } else {
      vsum = exp_in_place(s, 0, padded, m, _mm256_setzero_ps());
    }
    row_sum[r] = hsum(vsum);
    row_max[r] = m;
  }
  for (int64_t b0 = key_begin; b0 < key_end; b0 += bs) {
    const int64_t block = table[b0 / bs], n = std::min(bs, key_end - b0);
    for (int64_t kv = 0; kv < p.num_kv_heads; ++kv) {
      if (b0 + bs < key_end) prefetch_head<_MM_HINT_T0>(p, p.v_cache, table[b0 / bs + 1], kv, std::min(bs, key_end - b0 - bs));
      if (visible((kv + 1) * per_kv - 1, b0, n) == 0) continue;  // the head's last row sees the most
      with_head_rows(p.v_cache, block, kv, n, [&](const auto* values, int64_t stride) {
        for_groups(kv, [&](auto R, int64_t r0) {
          const int64_t count = visible(r0 + R - 1, b0, n);
          if (count == 0) return;
          float* a[R];
          const float* w[R];
          for (int r = 0; r < R; ++r) {
            a[r] = acc + (r0 + r) * d;
            w[r] = scores + (r0 + r) * sstride + (b0 - key_begin);
          }
          if constexpr (Wide) {
            wide_values<NV, R>(a, w, values, stride, count, d);
          } else {
            group_values<quant::V8, NV, R>(a, w, values, stride, count, d);
          }
        });
      });
    }
  }
}

template <int NV, typename T>
void attend(const Problem& p, const Tile& tile, int64_t key_begin, int64_t key_end, float* acc, float* row_max,
            float* row_sum, float* qbuf, float* kvbuf, float* scores) {
  attend_rows<NV, T, 1, false>(p, tile, key_begin, key_end, acc, row_max, row_sum, qbuf, kvbuf, scores);
}

// The same arithmetic with three rows per group: AVX-512VL gives the 32 ymm registers
// that three rows' accumulators need.
template <int NV, typename T>
__attribute__((target("avx512f,avx512vl"))) void attend512(const Problem& p, const Tile& tile, int64_t key_begin,
                                                           int64_t key_end, float* acc, float* row_max, float* row_sum,
                                                           float* qbuf, float* kvbuf, float* scores) {
  attend_rows<NV, T, 3, true>(p, tile, key_begin, key_end, acc, row_max, row_sum, qbuf, kvbuf, scores);
}

using AttendFn = void (*)(const Problem&, const Tile&, int64_t, int64_t, float*, float*, float*, float*, float*,
                          float*);

template <typename T>
AttendFn attend_for(int64_t head_dim) {
  const bool wide = use_avx512vl();
  mark_isa_path(wide ? IsaPath::kAttentionAvx512vl : IsaPath::kAttentionAvx2);
  switch (head_dim) {
    case 64: return wide ? attend512<8, T> : attend<8, T>;
    case 128: return wide ? attend512<16, T> : attend<16, T>;
    default: return wide ? attend512<0, T> : attend<0, T>;
  }
}

// 1 / a row's softmax denominator, in units of exp(row_max): its sum, plus its head's
// sink exp(sink - row_max) where there is one. Past the keys' max the sink becomes the
// reference (the factor exp(row_max - sink) on both terms), so a large sink cannot overflow.
inline float row_inverse(const Problem& p, int64_t head, float row_max, float row_sum) {
  if (row_sum <= 0.0f) return 0.0f;  // no key visible: the output is zeros either way
  if (p.sinks == nullptr) return 1.0f / row_sum;
  const float sink = p.sinks[head];
  if (sink <= row_max) return 1.0f / (row_sum + std::exp(sink - row_max));
  const float keys = std::exp(row_max - sink);
  return keys / (row_sum * keys + 1.0f);
}

// A tile's output rows from its unnormalised ones.
void write_rows(const Problem& p, const Tile& tile, const float* acc, const float* row_max, const float* row_sum) {
  const int64_t d = p.head_dim, g = p.group, start = p.query_start[tile.seq] + tile.token_begin, qlen = tile.tokens;
  for (int64_t r = 0, rows = qlen * g * p.num_kv_heads; r < rows; ++r) {
    const RowIndex ri = row_index(r, qlen, g);
    float* dst = p.out + (start + ri.token) * p.out_token_stride + ri.head * d;
    const float inv = row_inverse(p, ri.head, row_max[r], row_sum[r]);
    for (int64_t i = 0; i < d; ++i) dst[i] = acc[r * d + i] * inv;
  }
}

// Merges the parts of a split sequence: each part's partial is laid out as
// acc [rows][d], max [rows], sum [rows].
void merge_parts(const Problem& p, const SplitGroup& sg, const float* partials, float* acc, float* row_max,
                 float* row_sum) {
  const int64_t d = p.head_dim, rows = sg.rows, stride = rows * (d + 2);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegInf;
    for (int64_t k = 0; k < sg.num_parts; ++k) m = std::max(m, partials[sg.first_partial + k * stride + rows * d + r]);
    float sum = 0.0f;
    std::fill_n(acc + r * d, d, 0.0f);
    if (m != kNegInf) {
      for (int64_t k = 0; k < sg.num_parts; ++k) {
        const float* part = partials + sg.first_partial + k * stride;
        const float pm = part[rows * d + r];
        if (pm == kNegInf) continue;
        const float w = std::exp(pm - m);
        sum += part[rows * d + rows + r] * w;
        for (int64_t i = 0; i < d; ++i) acc[r * d + i] += part[r * d + i] * w;
      }
    }
    row_max[r] = m;
    row_sum[r] = sum;
  }
}

// Over 80 lines because its split into plan_items and run_items was built only together
// with attend_rows's, which lost the op's prefetches, so it is not known to be safe apart.
void paged_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& seq_ids,
                      double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention_: window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_attention_: float32 q and out expected");
  AttendFn fn = nullptr;
  dispatch_kv_type(kv_cache.scalar_type(), "paged_attention_", [&](auto* type_tag) {
    fn = attend_for<std::remove_pointer_t<decltype(type_tag)>>(q.size(2));
  });
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention_: q must be [tokens, heads, head_dim], rows contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention_: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t num_heads = q.size(1), d = q.size(2), bs = kv_cache.size(2), hkv = kv_cache.size(3);
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                                     sinks->size(0) == num_heads && sinks->is_contiguous()),
              "paged_attention_: sinks must be a contiguous float32 [num_heads] tensor");
  TORCH_CHECK(kv_cache.size(4) == d && d % 8 == 0, "paged_attention_: head_dim must match the cache and be a multiple of 8");
  TORCH_CHECK(num_heads % hkv == 0, "paged_attention_: query heads must be a multiple of KV heads");
  TORCH_CHECK(bs <= kMaxBlockSize, "paged_attention_: block_size above ", kMaxBlockSize);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == num_heads * d && out.stride(1) == 1,
              "paged_attention_: out must be [tokens, heads * head_dim], rows contiguous");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens, &seq_ids})
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_attention_: int64 index tensors expected");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "paged_attention_: block_tables rows must be contiguous");
  const at::Tensor qsl = query_start_loc.contiguous(), lens = seq_lens.contiguous(), ids = seq_ids.contiguous();
  const int64_t num_seqs = lens.numel();
  TORCH_CHECK(qsl.numel() == num_seqs + 1 && block_tables.size(0) >= num_seqs,
              "paged_attention_: query_start_loc, seq_lens and block_tables disagree on the number of sequences");

  const int64_t* qs = qsl.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t g = num_heads / hkv;
  Problem p{q.data_ptr<float>(), q.stride(0), q.stride(1),
            kv_cache.data_ptr(), static_cast<const char*>(kv_cache.data_ptr()) + kv_cache.stride(0) * kv_cache.element_size(),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.element_size(),
            block_tables.data_ptr<int64_t>(), block_tables.stride(0), qs, sl,
            bs, hkv, g, d, static_cast<float>(scale), out.data_ptr<float>(), out.stride(0),
            (kPartitionKeys + bs - 1) / bs * bs, window, static_cast<float>(softcap),
            sinks.has_value() ? sinks->data_ptr<float>() : nullptr};

  const int64_t* seq_index = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = seq_index[i];
    TORCH_CHECK(s >= 0 && s < num_seqs, "paged_attention_: seq_ids out of range");
    const int64_t qlen = qs[s + 1] - qs[s];
    TORCH_CHECK(qlen >= 0 && qlen <= sl[s] && qs[s + 1] <= q.size(0), "paged_attention_: sequence ", s,
                " has query_len above seq_len or beyond q");
    TORCH_CHECK(-(-sl[s] / bs) <= block_tables.size(1), "paged_attention_: sequence ", s, " has more blocks than its table");
  }
  // Tokens per tile: whole tokens, all their query heads.
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / num_heads);
  const int64_t threads = at::get_num_threads();
  const int64_t part_keys = p.partition_keys;

  std::vector<Item> items;
  std::vector<SplitGroup> groups;
  int64_t partial_floats = 0;
  int64_t max_rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = seq_index[i], qlen = qs[s + 1] - qs[s];
    for (int64_t t0 = 0; t0 < qlen; t0 += tile_tokens) {
      const Tile tile{s, t0, std::min(tile_tokens, qlen - t0)};
      // Keys up to the tile's last token: no row of the tile sees past it.
      const int64_t rows = tile.tokens * num_heads, keys = sl[s] - qlen + t0 + tile.tokens;
      max_rows = std::max(max_rows, rows);
      // Partitions sit at fixed positions; those before the tile's first row's window are skipped.
      const int64_t first_part = window_start(p, sl[s] - qlen + t0) / part_keys;
      const int64_t parts = (keys + part_keys - 1) / part_keys - first_part;
      if (parts == 1) {
        const int64_t b = first_part * part_keys;
        items.push_back({tile, b, keys, -1, -1, (keys - b) * rows});
        continue;
      }
      const int64_t first = partial_floats, stride = rows * (d + 2);
      for (int64_t k = 0; k < parts; ++k) {
        const int64_t b = (first_part + k) * part_keys, e = std::min(keys, b + part_keys);
        items.push_back({tile, b, e, static_cast<int64_t>(groups.size()), first + k * stride, (e - b) * rows});
      }
      groups.push_back({tile, first, parts, rows});
      partial_floats += parts * stride;
    }
  }
  // Longest first, taken from a shared counter: uneven items balance across threads.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<float> partials(partial_floats);
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[groups.size()]);
  for (size_t i = 0; i < groups.size(); ++i) remaining[i].store(groups[i].num_parts, std::memory_order_relaxed);

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto work = [&](int64_t, int64_t) {
    std::vector<float> scratch(max_rows * (2 * d + 2) + 2 * bs * d + max_rows * (part_keys + 8));
    float* qbuf = scratch.data();
    float* acc = qbuf + max_rows * d;
    float* row_max = acc + max_rows * d;
    float* row_sum = row_max + max_rows;
    float* kvbuf = row_sum + max_rows;
    float* scores = kvbuf + 2 * bs * d;  // kvbuf: a block's widened rows, then its transposed keys
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& it = items[i];
      const int64_t rows = it.tile.tokens * num_heads;
      if (it.group_index < 0) {
        fn(p, it.tile, it.key_begin, it.key_end, acc, row_max, row_sum, qbuf, kvbuf, scores);
        write_rows(p, it.tile, acc, row_max, row_sum);
        continue;
      }
      float* part = partials.data() + it.partial;
      fn(p, it.tile, it.key_begin, it.key_end, part, part + rows * d, part + rows * d + rows, qbuf, kvbuf, scores);
      // The part that finishes its group last merges it; acq_rel makes the others' partials visible.
      if (remaining[it.group_index].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        const SplitGroup& sg = groups[it.group_index];
        merge_parts(p, sg, partials.data(), acc, row_max, row_sum);
        write_rows(p, sg.tile, acc, row_max, row_sum);
      }
    }
  };
  if (num_items <= 1 || threads == 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, std::min(threads, num_items), 1, work);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "paged_attention_(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor seq_ids, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> ()",
      &paged_attention_);
}

}  // namespace pagedserve
