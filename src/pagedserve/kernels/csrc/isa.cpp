// native_isa(): the widest instruction set the kernels use now (isa.h), for the start-up
// log and for tests that check the dispatch follows the CPU.
#include "isa.h"

#include <torch/library.h>

#include <string>

namespace pagedserve {
namespace {

std::string native_isa() {
  if (use_avx512_vnni()) return "avx512_vnni";
  if (use_avx512()) return "avx512";
  return "avx2";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("native_isa() -> str", &native_isa); }

}  // namespace pagedserve
