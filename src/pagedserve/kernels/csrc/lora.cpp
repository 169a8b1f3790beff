// Multi-LoRA delta over one fused layer: y[r] += (x[r] A_s) B_s for each adapter row r of
// the step, each with its own slot s (model/lora.py's stacks: A^T [slots, in, R], B^T
// [slots, R, out], zeros past an adapter's rank; `widths[s]` columns of slot s are used,
// 0 when its adapter does not target this layer).
//
// Why: in torch the delta is a gather, two small GEMMs per adapter segment and a
// scatter-add per fused layer; at decode sizes (8 rows an adapter) those ~1,300 calls a
// step cost more than their arithmetic (a 32-row batch over 4 adapters ran at 0.77x the
// base model). Here up to four rows of one adapter do their shrink (x A) and expand (B
// added straight into y's rows) together, sharing each load of A and B, groups in
// parallel; every row's arithmetic is in a fixed order (k = 0..in-1, then j = 0..w-1),
// so its result does not depend on the batch around it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

namespace pagedserve {
namespace {

constexpr int64_t kGroup = 4;  // rows of one slot sharing each load of A and B
constexpr int64_t kStrip = 16;  // columns per register strip: 2 ymm x kGroup rows = 8 accumulators

// s[g][0:w] = x_g[0:in] A[0:in, 0:w] for the G rows x_g; A's rows `lda` apart, s rows `w` apart.
template <int G>
void shrink(const float* const* x, int64_t in, const float* a, int64_t lda, int64_t w, float* s) {
  int64_t j0 = 0;
  for (; j0 + kStrip <= w; j0 += kStrip) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; ++k) {
      const float* row = a + k * lda + j0;
      const __m256 a0 = _mm256_loadu_ps(row), a1 = _mm256_loadu_ps(row + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 xk = _mm256_set1_ps(x[g][k]);
        acc[g][0] = _mm256_fmadd_ps(xk, a0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(xk, a1, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(s + g * w + j0, acc[g][0]);
      _mm256_storeu_ps(s + g * w + j0 + 8, acc[g][1]);
    }
  }
  for (; j0 < w; ++j0)  // a rank not a multiple of the strip: the last columns one by one
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t k = 0; k < in; ++k) acc = std::fma(x[g][k], a[k * lda + j0], acc);
      s[g * w + j0] = acc;
    }
}

// y_g[0:out] += s[g][0:w] B[0:w, 0:out] for the G rows y_g; B's rows `out` apart.
template <int G>
void expand(const float* s, int64_t w, const float* b, int64_t out, float* const* y) {
  int64_t c = 0;
  for (; c + kStrip <= out; c += kStrip) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) {
      acc[g][0] = _mm256_loadu_ps(y[g] + c);
      acc[g][1] = _mm256_loadu_ps(y[g] + c + 8);
    }
    for (int64_t j = 0; j < w; ++j) {
      const float* row = b + j * out + c;
      const __m256 b0 = _mm256_loadu_ps(row), b1 = _mm256_loadu_ps(row + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 sj = _mm256_set1_ps(s[g * w + j]);
        acc[g][0] = _mm256_fmadd_ps(sj, b0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(sj, b1, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(y[g] + c, acc[g][0]);
      _mm256_storeu_ps(y[g] + c + 8, acc[g][1]);
    }
  }
  for (; c < out; ++c)
    for (int g = 0; g < G; ++g) {
      float acc = y[g][c];
      for (int64_t j = 0; j < w; ++j) acc = std::fma(s[g * w + j], b[j * out + c], acc);
      y[g][c] = acc;
    }
}

template <int G>
void group_add(const float* const* x, float* const* y, int64_t in, int64_t out, const float* a, const float* b,
               int64_t rmax, int64_t w, float* s) {
  shrink<G>(x, in, a, rmax, w, s);
  expand<G>(s, w, b, out, y);
}

at::Tensor& lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& slots,
                      const at::Tensor& widths, const at::Tensor& a_stack, const at::Tensor& b_stack) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous(), "lora_add_: y must be a contiguous float32 [T, out] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(0) == y.size(0),
              "lora_add_: x must be a contiguous float32 [T, in] tensor with y's rows");
  TORCH_CHECK(a_stack.scalar_type() == at::kFloat && a_stack.dim() == 3 && a_stack.is_contiguous() &&
                  a_stack.size(1) == x.size(1),
              "lora_add_: a_stack must be a contiguous float32 [slots, in, R] tensor");
  TORCH_CHECK(b_stack.scalar_type() == at::kFloat && b_stack.dim() == 3 && b_stack.is_contiguous() &&
                  b_stack.size(0) == a_stack.size(0) && b_stack.size(1) == a_stack.size(2) && b_stack.size(2) == y.size(1),
              "lora_add_: b_stack must be a contiguous float32 [slots, R, out] tensor matching a_stack and y");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && rows.dim() == 1 &&
                  slots.sizes() == rows.sizes() && rows.is_contiguous() && slots.is_contiguous(),
              "lora_add_: rows and slots must be contiguous int64 vectors of one length");
  TORCH_CHECK(widths.scalar_type() == at::kLong && widths.dim() == 1 && widths.size(0) == a_stack.size(0) &&
                  widths.is_contiguous(),
              "lora_add_: widths must be a contiguous int64 [slots] vector");
  const int64_t n = rows.size(0), t = y.size(0), in = x.size(1), out = y.size(1);
  const int64_t num_slots = a_stack.size(0), rmax = a_stack.size(2);
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t* width_ptr = widths.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ptr[i] >= 0 && row_ptr[i] < t, "lora_add_: row ", row_ptr[i], " out of range");
    TORCH_CHECK(slot_ptr[i] >= 0 && slot_ptr[i] < num_slots, "lora_add_: slot ", slot_ptr[i], " out of range");
  }
  for (int64_t s = 0; s < num_slots; ++s)
    TORCH_CHECK(width_ptr[s] >= 0 && width_ptr[s] <= rmax, "lora_add_: width ", width_ptr[s], " out of [0, ", rmax, "]");
  const float* xp = x.data_ptr<float>();
  const float* ap = a_stack.data_ptr<float>();
  const float* bp = b_stack.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Groups of up to kGroup consecutive rows of one slot share each read of its A and B
  // (rows arrive sorted by slot). Rows are distinct (a token runs one adapter), so groups
  // never write the same row; each row's arithmetic is the same whatever its group.
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || slot_ptr[i] != slot_ptr[i - 1] || i - starts.back() == kGroup) starts.push_back(i);
  starts.push_back(n);
  const int64_t num_groups = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> s(kGroup * rmax);
    for (int64_t gi = g0; gi < g1; ++gi) {
      const int64_t first = starts[gi], size = starts[gi + 1] - first, slot = slot_ptr[first], w = width_ptr[slot];
      if (w == 0) continue;
      const float* xs[kGroup];
      float* ys[kGroup];
      for (int64_t g = 0; g < size; ++g) {
        xs[g] = xp + row_ptr[first + g] * in;
        ys[g] = yp + row_ptr[first + g] * out;
      }
      const float* a = ap + slot * in * rmax;
      const float* b = bp + slot * rmax * out;
      switch (size) {
        case 1: group_add<1>(xs, ys, in, out, a, b, rmax, w, s.data()); break;
        case 2: group_add<2>(xs, ys, in, out, a, b, rmax, w, s.data()); break;
        case 3: group_add<3>(xs, ys, in, out, a, b, rmax, w, s.data()); break;
        default: group_add<4>(xs, ys, in, out, a, b, rmax, w, s.data()); break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor rows, Tensor slots, Tensor widths, Tensor a_stack, "
        "Tensor b_stack) -> Tensor(a!)",
        &lora_add_);
}

}  // namespace pagedserve
