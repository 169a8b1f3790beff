// native_isa(): the widest instruction set the kernels use now (isa.h), for the start-up
// log and for tests that check the dispatch follows the CPU; isa_paths_*(): which kernel
// paths exist, which this CPU can run and which this process has run (the test summary).
#include "isa.h"

#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace pagedserve {
namespace {

std::string native_isa() {
  if (use_avx512_vnni()) return "avx512_vnni";
  if (use_avx512()) return "avx512";
  return "avx2";
}

struct PathName {
  IsaPath path;
  const char* name;
  bool (*cpu_has)();
};

bool always() { return true; }

const PathName kPaths[] = {
    {IsaPath::kAttentionAvx2, "paged_attention:avx2", always},
    {IsaPath::kAttentionAvx512vl, "paged_attention:avx512vl", cpu_has_avx512vl},
    {IsaPath::kDequantLinearAvx2, "dequant_linear:avx2", always},
    {IsaPath::kDequantLinearAvx512, "dequant_linear:avx512f", cpu_has_avx512},
    {IsaPath::kQuantLinearAvx2, "quant_linear:avx2", always},
    {IsaPath::kQuantLinearAvx512Vnni, "quant_linear:avx512_vnni", cpu_has_avx512_vnni},
    {IsaPath::kMoeExpertsInt8Avx2, "moe_experts_int8:avx2", always},
    {IsaPath::kMoeExpertsInt8Avx512Vnni, "moe_experts_int8:avx512_vnni", cpu_has_avx512_vnni},
};

// Every path this process has run, or every path this CPU can run (`available`).
std::vector<std::string> isa_paths(bool available) {
  const unsigned taken = isa_paths_taken().load(std::memory_order_relaxed);
  std::vector<std::string> out;
  for (const PathName& p : kPaths)
    if (available ? p.cpu_has() : (taken & static_cast<unsigned>(p.path)) != 0) out.emplace_back(p.name);
  return out;
}

std::vector<std::string> all_isa_paths() {
  std::vector<std::string> out;
  for (const PathName& p : kPaths) out.emplace_back(p.name);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("native_isa() -> str", &native_isa);
  m.def("isa_paths_taken() -> str[]", [] { return isa_paths(false); });
  m.def("isa_paths_available() -> str[]", [] { return isa_paths(true); });
  m.def("isa_paths_all() -> str[]", &all_isa_paths);
}

}  // namespace pagedserve
