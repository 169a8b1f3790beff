// Rotary position embedding applied in place to a step's q and k, in one op.
//
// Why: in torch it is nine ops a call and two calls a layer (halves, four products, a
// difference, a sum, a concatenation), each allocating and passing over [T, heads, D];
// ~3% of a 256-token prefill step and more of a decode step, whose tensors are small and
// whose op count is what costs. The arithmetic is torch's, product by product:
// x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded, then the sum (never
// fused into an fma), so the op gives the torch path's bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

namespace pagedserve {
namespace {

// Kept apart from fma contraction: a fused a * b - c * d would round once where torch
// rounds three times.
__attribute__((optimize("fp-contract=off"))) inline void rotate_head(float* x, const float* cos, const float* sin,
                                                                      int64_t half) {
  float* x2p = x + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x2p + i);
    const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
    _mm256_storeu_ps(x2p + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x2p[i];
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
    x[i] = a - b;
    x2p[i] = c + d;
  }
}

void check_rotated(const at::Tensor& x, const char* name, int64_t tokens) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(0) == tokens && x.stride(2) == 1 &&
                  x.size(2) % 2 == 0,
              "rotary_: ", name, " must be float32 [tokens, heads, head_dim] with an even head_dim and unit stride in it");
}

// q [T, Hq, D] and k [T, Hk, D] (views into the fused qkv output are fine: any row and
// head strides); cos and sin [T, 1, D/2] or [T, D/2], rows at any stride.
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  check_rotated(q, "q", tokens);
  check_rotated(k, "k", tokens);
  TORCH_CHECK(k.size(2) == q.size(2), "rotary_: q and k must have the same head_dim");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->size(0) == tokens && t->size(-1) == half && t->stride(-1) == 1 &&
                    t->numel() == tokens * half,
                "rotary_: cos and sin must be float32 [tokens, 1, head_dim / 2] with unit stride in the last dimension");
  }
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t hq = q.size(1), hk = k.size(1);
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * cos.stride(0);
      const float* s = sp + t * sin.stride(0);
      for (int64_t h = 0; h < hq; ++h) rotate_head(qp + t * q.stride(0) + h * q.stride(1), c, s, half);
      for (int64_t h = 0; h < hk; ++h) rotate_head(kp + t * k.stride(0) + h * k.stride(1), c, s, half);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rotary_);
}

}  // namespace pagedserve
