// A mixture-of-experts MLP on GGUF blocks: for each row t of x and its k routed experts e
// with router weights w, out[t] = sum_j w_j * down_e(silu(gate_e(x_t)) * up_e(x_t)), each
// expert's gate, up and down held as the packed tiles of quant_repack (quant_linear.h),
// one tile stack per expert, in any type dequant_linear reads (gate, up and down may differ:
// Q4_K_M keeps down in Q6_K on some layers). Two ops, the engine's two arithmetics:
// moe_experts multiplies in fp32 (dequant_linear's products, --quantization none) and
// moe_experts_int8 with int8 activations (quant_linear's, --quantization gguf; not F16 / BF16).
//
// Why: a step touches only the experts its rows were sent to (decode: k of E), so only
// their blocks are read; one op per layer instead of three per expert keeps Python out of
// the loop. The (row, expert) pairs are sorted by expert (a counting sort, stable: rows in
// order within an expert), so each expert multiplies one contiguous slice of gathered rows,
// and the (expert, group of four tiles) tasks of all experts share one parallel loop.
//
// Order: the products are dequant_linear's (dequant_tiles) or quant_linear's (the gathered
// rows quantised by quantize_activations, then quant_tiles), whose bits do not depend on the
// rows beside a row, the thread count or the instruction set: the int8 op gives a row's
// gate, up and down products exactly as quant_linear on that row alone. silu is silu_mul's;
// a row's k results are added in ascending expert id, each as one fma of its weight into the
// sum (0 first). So a row's output is the same bits alone or in any batch, on every path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "quant_linear.h"
#include "vec.h"

namespace pagedserve::quant {
namespace {

// One of gate, up, down: every expert's tiles, experts `expert_bytes` apart.
struct ExpertMatrix {
  const uint8_t* tiles;
  int64_t qtype, expert_bytes, stride, nb, ng, k, n;  // n outputs from k inputs
};

ExpertMatrix check_matrix(const char* name, const at::Tensor& packed, int64_t qtype, int64_t experts, int64_t k,
                          int64_t n) {
  const PackedLayout L = packed_layout(qtype);
  TORCH_CHECK(L.blocks != 0, "moe_experts: ", name, " qtype ", qtype, " is not a GGML type id quant_repack packs");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(0) == experts && packed.size(3) == L.super_bytes(),
              "moe_experts: ", name, " must be [experts, tile groups, super-blocks, bytes] from quant_repack");
  const int64_t nb = packed.size(2) * L.blocks, ng = packed.size(1);
  TORCH_CHECK(nb * kBlock == k, "moe_experts: ", name, " takes ", nb * kBlock, " inputs, not ", k);
  TORCH_CHECK(ng == (n + kTileCols - 1) / kTileCols, "moe_experts: ", name, " has ", ng, " tile groups for ", n,
              " outputs");
  const int64_t stride = packed.size(2) * packed.size(3);
  return {packed.data_ptr<uint8_t>(), qtype, ng * stride, stride, nb, ng, k, n};
}

// in [pairs, w.k] -> out [pairs, w.n], expert e's rows being start[e] .. start[e] + count[e] - 1:
// fp32 (dequant_tiles) where `a` is null, else on a's int8 rows of `in` (quant_tiles).
void run_experts(const ExpertMatrix& w, const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                 const float* in, const Int8Rows* a, float* out, bool wide) {
  struct Task {
    int64_t expert, t0, nt;
  };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < static_cast<int64_t>(count.size()); ++e)
    for (int64_t g = 0; count[e] > 0 && g < w.ng; g += 4) tasks.push_back({e, g, std::min<int64_t>(4, w.ng - g)});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Task& t = tasks[i];
      const uint8_t* tiles = w.tiles + t.expert * w.expert_bytes;
      float* dst = out + start[t.expert] * w.n;
      if (a == nullptr) {
        dequant_tiles(w.qtype, t.t0, t.nt, count[t.expert], tiles, w.stride, w.nb, in + start[t.expert] * w.k, w.k,
                      dst, w.n, nullptr, wide);
      } else {  // four groups a task: whole quant_linear tasks on either path (quant_task_groups 1 or 4)
        for (int64_t g = t.t0; g < t.t0 + t.nt; g += quant_task_groups(wide))
          quant_tiles(w.qtype, g, std::min(g + quant_task_groups(wide), t.t0 + t.nt), count[t.expert], tiles,
                      w.stride, a->from(start[t.expert]), dst, w.n, nullptr, wide);
      }
    }
  });
}

// g = silu(g) * u over [pairs, n], as silu_mul computes it.
void silu_mul_into(float* g, const float* u, int64_t pairs, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, pairs, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* gr = g + r * n;
      const float* ur = u + r * n;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gr + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(gr + i, _mm256_mul_ps(s, _mm256_loadu_ps(ur + i)));
      }
      for (; i < n; ++i) gr[i] = gr[i] / (1.0f + std::exp(-gr[i])) * ur[i];
    }
  });
}

// The (row, slot) pairs sorted by expert: slot_pos[t * k + j] is pair (t, j)'s place.
struct Grouping {
  std::vector<int64_t> start, count, slot_pos;
};

Grouping group_by_expert(const int64_t* ids, int64_t pairs, int64_t experts) {
  Grouping gr{std::vector<int64_t>(experts, 0), std::vector<int64_t>(experts, 0), std::vector<int64_t>(pairs)};
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "moe_experts: expert id ", ids[p], " out of range [0, ", experts,
                ")");
    ++gr.count[ids[p]];
  }
  for (int64_t e = 1; e < experts; ++e) gr.start[e] = gr.start[e - 1] + gr.count[e - 1];
  std::vector<int64_t> next(gr.start);
  for (int64_t p = 0; p < pairs; ++p) gr.slot_pos[p] = next[ids[p]]++;
  return gr;
}

// The three products of every pair's expert, fp32 or int8 activations, on one path:
// gate and up into gs and us, silu(gs) * us into gs, then down into ds.
void expert_products(const ExpertMatrix& g, const ExpertMatrix& u, const ExpertMatrix& d, const Grouping& gr,
                     const at::Tensor& xs, at::Tensor& gs, at::Tensor& us, at::Tensor& ds, bool int8) {
  const int64_t pairs = xs.size(0), expert_size = gs.size(1);
  float* gp = gs.data_ptr<float>();
  if (!int8) {
    const bool avx512 = use_avx512();
    mark_isa_path(avx512 ? IsaPath::kDequantLinearAvx512 : IsaPath::kDequantLinearAvx2);
    run_experts(g, gr.start, gr.count, xs.data_ptr<float>(), nullptr, gp, avx512);
    run_experts(u, gr.start, gr.count, xs.data_ptr<float>(), nullptr, us.data_ptr<float>(), avx512);
    silu_mul_into(gp, us.data_ptr<float>(), pairs, expert_size);
    run_experts(d, gr.start, gr.count, gp, nullptr, ds.data_ptr<float>(), avx512);
    return;
  }
  const bool vnni = use_avx512_vnni();
  mark_isa_path(vnni ? IsaPath::kMoeExpertsInt8Avx512Vnni : IsaPath::kMoeExpertsInt8Avx2);
  // Each gathered row quantised once for gate and up (quant_linear quantises a row the same
  // way whatever its weight), the silu products again for down.
  const Int8Activations xq =
      quantize_activations(xs.data_ptr<float>(), pairs, g.k, vnni && (g.qtype == kQ8_0 || u.qtype == kQ8_0),
                           xs.options());
  run_experts(g, gr.start, gr.count, nullptr, &xq.rows, gp, vnni);
  run_experts(u, gr.start, gr.count, nullptr, &xq.rows, us.data_ptr<float>(), vnni);
  silu_mul_into(gp, us.data_ptr<float>(), pairs, expert_size);
  const Int8Activations aq = quantize_activations(gp, pairs, expert_size, vnni && d.qtype == kQ8_0, xs.options());
  run_experts(d, gr.start, gr.count, nullptr, &aq.rows, ds.data_ptr<float>(), vnni);
}

at::Tensor experts_op(const char* op, const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                      const at::Tensor& gate, int64_t gate_qtype, const at::Tensor& up, int64_t up_qtype,
                      const at::Tensor& down, int64_t down_qtype, int64_t expert_size, bool int8) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be float32 [rows, hidden]");
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0),
              op, ": expert_ids must be int64 [rows, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == expert_ids.sizes(), op,
              ": weights must be float32 [rows, k]");
  TORCH_CHECK(!int8 || !(is_half(gate_qtype) || is_half(up_qtype) || is_half(down_qtype)), op,
              ": F16 / BF16 experts have no int8 form; moe_experts reads them");
  const int64_t rows = x.size(0), k = expert_ids.size(1), h = x.size(1), experts = gate.size(0);
  const ExpertMatrix g = check_matrix("gate", gate, gate_qtype, experts, h, expert_size);
  const ExpertMatrix u = check_matrix("up", up, up_qtype, experts, h, expert_size);
  const ExpertMatrix d = check_matrix("down", down, down_qtype, experts, expert_size, h);
  at::Tensor out = at::zeros({rows, h}, x.options());
  const int64_t pairs = rows * k;
  if (pairs == 0) return out;
  const at::Tensor xin = x.contiguous(), ids = expert_ids.contiguous(), win = weights.contiguous();
  const Grouping gr = group_by_expert(ids.data_ptr<int64_t>(), pairs, experts);
  at::Tensor xs = at::empty({pairs, h}, x.options());
  at::Tensor gs = at::empty({pairs, expert_size}, x.options()), us = at::empty({pairs, expert_size}, x.options());
  at::Tensor ds = at::empty({pairs, h}, x.options());
  const float* src = xin.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t p = 0; p < pairs; ++p) std::memcpy(xsp + gr.slot_pos[p] * h, src + (p / k) * h, h * sizeof(float));
  expert_products(g, u, d, gr, xs, gs, us, ds, int8);
  const float* dsp = ds.data_ptr<float>();
  const float* w = win.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> slots(k);
    for (int64_t t = r0; t < r1; ++t) {
      // A row's experts in ascending id: their sorted places ascend with the id.
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return gr.slot_pos[a] < gr.slot_pos[b]; });
      for (const int64_t p : slots) {
        const float* dr = dsp + gr.slot_pos[p] * h;
        for (int64_t i = 0; i < h; ++i) o[t * h + i] = std::fma(w[p], dr[i], o[t * h + i]);
      }
    }
  });
  return out;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                       const at::Tensor& gate, int64_t gate_qtype, const at::Tensor& up, int64_t up_qtype,
                       const at::Tensor& down, int64_t down_qtype, int64_t expert_size) {
  return experts_op("moe_experts", x, expert_ids, weights, gate, gate_qtype, up, up_qtype, down, down_qtype,
                    expert_size, false);
}

at::Tensor moe_experts_int8(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                            const at::Tensor& gate, int64_t gate_qtype, const at::Tensor& up, int64_t up_qtype,
                            const at::Tensor& down, int64_t down_qtype, int64_t expert_size) {
  return experts_op("moe_experts_int8", x, expert_ids, weights, gate, gate_qtype, up, up_qtype, down, down_qtype,
                    expert_size, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("moe_experts(Tensor x, Tensor expert_ids, Tensor weights, Tensor gate, int gate_qtype, Tensor up, "
        "int up_qtype, Tensor down, int down_qtype, int expert_size) -> Tensor",
        &moe_experts);
  m.def("moe_experts_int8(Tensor x, Tensor expert_ids, Tensor weights, Tensor gate, int gate_qtype, Tensor up, "
        "int up_qtype, Tensor down, int down_qtype, int expert_size) -> Tensor",
        &moe_experts_int8);
}

}  // namespace pagedserve::quant
