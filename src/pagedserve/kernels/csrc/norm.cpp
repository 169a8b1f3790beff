// RMSNorm on fp32 rows, and the residual-add + RMSNorm pair every decoder layer runs
// twice. torch's F.rms_norm on CPU decomposes into ~7 ops (two of them dtype copies):
// ~76 us per call at one row on this project's machine, 61 calls a step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

namespace pagedserve {
namespace {

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: float32 tensors expected");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "rms_norm: x must be contiguous in its last dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
              "rms_norm: weight must be a contiguous vector of x's last dimension");
}

// out = in * rsqrt(mean(in^2) + eps) * weight, one row of n values.
inline void norm_row(const float* in, const float* weight, float* out, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(in + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += in[i] * in[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + i), vinv);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
  }
  for (; i < n; ++i) out[i] = in[i] * inv * weight[i];
}

// Rows per task: a row of a small model's hidden state is ~1 us of work, so tiny
// batches stay on one thread rather than paying a fork/join.
constexpr int64_t kRowGrain = 16;

// A new tensor shaped like x whose row r is row_fn(x's row r, out row r, n), rows in parallel.
template <typename RowFn>
at::Tensor map_rows(const at::Tensor& x, const at::Tensor& weight, RowFn row_fn) {
  check_norm_args(x, weight);
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t n = in.size(-1), rows = n ? in.numel() / n : 0;
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_fn(r, src + r * n, dst + r * n, n);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const float* w = weight.data_ptr<float>();
  return map_rows(x, weight, [&](int64_t, const float* in, float* out, int64_t n) {
    norm_row(in, w, out, n, static_cast<float>(eps));
  });
}

// residual += x (in place), then returns rms_norm(residual): the layer's running
// hidden state and the next sub-block's normalised input from one pass over the row.
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "add_rms_norm_: residual must be a contiguous float32 tensor shaped like x");
  const float* w = weight.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  return map_rows(x, weight, [&](int64_t r, const float* add, float* out, int64_t n) {
    float* row = res + r * n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(add + i)));
    for (; i < n; ++i) row[i] += add[i];
    norm_row(row, w, out, n, static_cast<float>(eps));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor", &add_rms_norm_);
}

}  // namespace pagedserve
