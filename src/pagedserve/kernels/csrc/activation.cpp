// silu(gate) * up for the MLP, over [..., 2I] rows laid out [gate | up] (the fused
// gate_up projection's output). In torch it is three ops (a chunk, silu, mul) that
// each read and write the [T, I] intermediates.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

namespace pagedserve {
namespace {


inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

constexpr int64_t kRowGrain = 8;

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_mul: float32 tensor with an even last dimension expected");
  const at::Tensor in = x.contiguous();
  const int64_t width = in.size(-1), half = width / 2, rows = width ? in.numel() / width : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = half;
  at::Tensor out = at::empty(shape, x.options());
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = src + r * width;
      const float* up = gate + half;
      float* o = dst + r * half;
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_xor_ps(g, sign))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
      }
      for (; i < half; ++i) o[i] = silu(gate[i]) * up[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
}

}  // namespace pagedserve
