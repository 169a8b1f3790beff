// A prefill chunk's two attention halves merged straight into the step's output rows.
//
// A chunk after cached context is attended twice (attention/cpu_backend.attend_chunk):
// causally over its own keys, and over the earlier context with the query heads of a KV
// head folded into one pass. The whole is the halves' average weighted by each one's share
// of the probability mass (weights from their log-sum-exps, computed by the caller over
// [heads, Q], 1/D of the data). In torch the weighted sum is two products, a sum, an unfold
// of the folded half and a transposing copy into the output, each a pass over [heads, Q, D]
// (~4% of a 2,000-token prompt's prefill). Here it is one pass, with torch's rounding:
// each product rounded, then the sum (never an fma), so the op gives the torch path's bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

namespace pagedserve {
namespace {

// own [1, H, Q, D] and context [1, Hk, G * Q, D] (head h = kv * G + j is rows j * Q .. of
// kv: the folded half), each with its weights [1, H, Q]; out [T, H * D] contiguous, rows
// start .. start + Q written. Any strides but a unit one in D.
__attribute__((optimize("fp-contract=off"))) void merge_attention_(at::Tensor& out, int64_t start,
                                                                    const at::Tensor& own, const at::Tensor& own_weight,
                                                                    const at::Tensor& context,
                                                                    const at::Tensor& context_weight) {
  TORCH_CHECK(own.dim() == 4 && context.dim() == 4 && own.size(0) == 1 && context.size(0) == 1,
              "merge_attention_: own and context must be [1, heads, rows, head_dim]");
  const int64_t heads = own.size(1), q = own.size(2), d = own.size(3), kv_heads = context.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && context.size(2) == heads / kv_heads * q && context.size(3) == d,
              "merge_attention_: context must fold the query heads of each KV head: [1, kv_heads, heads / kv_heads * Q, D]");
  for (const at::Tensor* w : {&own_weight, &context_weight})
    TORCH_CHECK(w->dim() == 3 && w->size(0) == 1 && w->size(1) == heads && w->size(2) == q,
                "merge_attention_: each half's weights must be [1, heads, Q]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) == heads * d && start >= 0 &&
                  start + q <= out.size(0),
              "merge_attention_: out must be a contiguous [tokens, heads * head_dim] holding rows start .. start + Q");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &own, &own_weight, &context, &context_weight})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "merge_attention_: float32 tensors expected");
  TORCH_CHECK(own.stride(3) == 1 && context.stride(3) == 1, "merge_attention_: head_dim must have unit stride");
  const int64_t group = heads / kv_heads;
  const float* a = own.data_ptr<float>();
  const float* b = context.data_ptr<float>();
  const float* wa = own_weight.data_ptr<float>();
  const float* wb = context_weight.data_ptr<float>();
  float* o = out.data_ptr<float>() + start * heads * d;
  at::parallel_for(0, q, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float w1 = wa[h * own_weight.stride(1) + t * own_weight.stride(2)];
        const float w2 = wb[h * context_weight.stride(1) + t * context_weight.stride(2)];
        const __m256 v1 = _mm256_set1_ps(w1), v2 = _mm256_set1_ps(w2);
        const float* ar = a + h * own.stride(1) + t * own.stride(2);
        const float* br = b + (h / group) * context.stride(1) + ((h % group) * q + t) * context.stride(2);
        float* orow = o + t * heads * d + h * d;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8)
          _mm256_storeu_ps(orow + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(ar + i), v1),
                                                   _mm256_mul_ps(_mm256_loadu_ps(br + i), v2)));
        for (; i < d; ++i) {
          const float x = ar[i] * w1, y = br[i] * w2;
          orow[i] = x + y;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("merge_attention_(Tensor(a!) out, int start, Tensor own, Tensor own_weight, Tensor context, Tensor context_weight) -> ()",
        &merge_attention_);
}

}  // namespace pagedserve
