// Which instruction sets the kernels may use beyond the AVX2 + FMA + F16C they are built
// for: what the CPU reports, unless PAGEDSERVE_NATIVE_ISA=avx2. The variable is read per
// call, so tests run every path in one process and compare their bits; each wider path
// is written to give exactly the AVX2 path's results.
#pragma once

#include <cstdlib>
#include <cstring>

namespace pagedserve {

inline bool isa_forced_avx2() {
  const char* isa = std::getenv("PAGEDSERVE_NATIVE_ISA");
  return isa != nullptr && std::strcmp(isa, "avx2") == 0;
}

inline bool use_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has && !isa_forced_avx2();
}

// vpdpbusd on zmm (AVX512_VNNI), with AVX512BW for the byte shifts and masks around it.
inline bool use_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return has && !isa_forced_avx2();
}

}  // namespace pagedserve
