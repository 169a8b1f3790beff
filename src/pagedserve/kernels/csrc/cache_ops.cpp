// Writes a step's new K/V rows into their cache slots in one pass. The torch path is
// two index_copy_ calls on reshaped views of the cache, each with its own dispatch
// and checks; here one loop copies each token's K and V rows straight from the
// strided views the model's qkv split hands over, converting fp32 to the cache's
// element type (kv_types.h) on the way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "kv_types.h"

namespace pagedserve {
namespace {

// Tokens per task: a token's K/V is a few hundred bytes, so small steps copy on one thread.
constexpr int64_t kTokenGrain = 256;

template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), KVType<T>::from_float8(_mm256_loadu_ps(src + i)));
    for (; i < n; ++i) dst[i] = KVType<T>::from_float(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = KVType<T>::from_float(src[i]);
  }
}

void write_kv_(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv_: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t hkv = kv_cache.size(3), d = kv_cache.size(4), row = hkv * d;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "write_kv_: float32 k/v expected");
    TORCH_CHECK(t->dim() == 3 && t->size(1) == hkv && t->size(2) == d && t->stride(2) == 1 && t->stride(1) == d,
                "write_kv_: k/v must be [tokens, kv_heads, head_dim] with each token's heads contiguous");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.numel() == k.size(0) &&
                  v.size(0) == k.size(0),
              "write_kv_: slot_mapping must be int64 with one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t tokens = k.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_: slot ", slot[t], " out of range");
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  dispatch_kv_type(kv_cache.scalar_type(), "write_kv_", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    T* kc = static_cast<T*>(kv_cache.data_ptr());
    T* vc = kc + kv_cache.stride(0);
    at::parallel_for(0, tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        store_row(kc + slot[t] * row, ks + t * k_stride, row);
        store_row(vc + slot[t] * row, vs + t * v_stride, row);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()", &write_kv_);
}

}  // namespace pagedserve
