// Which instruction sets the kernels may use beyond the AVX2 + FMA + F16C they are built
// for: what the CPU reports, unless PAGEDSERVE_NATIVE_ISA=avx2. The variable is read per
// call, so tests run every path in one process and compare their bits; each wider path
// is written to give exactly the AVX2 path's results. Each check names every extension
// its path's instructions need (the compiler's target attribute on that path lists the
// same ones), so a CPU with AVX-512F but not VL or BW falls back instead of faulting.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace pagedserve {

inline bool isa_forced_avx2() {
  const char* isa = std::getenv("PAGEDSERVE_NATIVE_ISA");
  return isa != nullptr && std::strcmp(isa, "avx2") == 0;
}

// The fp32-on-blocks linear kernels' zmm path (dequant_linear.cpp).
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
inline bool use_avx512() { return cpu_has_avx512() && !isa_forced_avx2(); }

// Attention's three-rows-a-pass path: 32 ymm registers (paged_attention.cpp).
inline bool cpu_has_avx512vl() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return has;
}
inline bool use_avx512vl() { return cpu_has_avx512vl() && !isa_forced_avx2(); }

// vpdpbusd on zmm (AVX512_VNNI), with AVX512BW for the byte shifts and masks around it.
inline bool cpu_has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}
inline bool use_avx512_vnni() { return cpu_has_avx512_vnni() && !isa_forced_avx2(); }

// Every (kernel, instruction-set path) pair a call has taken in this process, so a test
// run can say which paths it actually exercised (tests/conftest.py prints them).
enum class IsaPath : unsigned {
  kAttentionAvx2 = 1u << 0,
  kAttentionAvx512vl = 1u << 1,
  kDequantLinearAvx2 = 1u << 2,
  kDequantLinearAvx512 = 1u << 3,
  kQuantLinearAvx2 = 1u << 4,
  kQuantLinearAvx512Vnni = 1u << 5,
  kMoeExpertsInt8Avx2 = 1u << 6,  // moe_experts_int8: quant_linear's tiles on each expert's rows
  kMoeExpertsInt8Avx512Vnni = 1u << 7,
};

inline std::atomic<unsigned>& isa_paths_taken() {
  static std::atomic<unsigned> taken{0};
  return taken;
}

inline void mark_isa_path(IsaPath path) {
  isa_paths_taken().fetch_or(static_cast<unsigned>(path), std::memory_order_relaxed);
}

}  // namespace pagedserve
