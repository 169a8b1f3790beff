"""How many KV blocks fit: the engine's own sizing (core/kv_plan.py, a draft model's
scratch included), with the pool taken from accelerator memory as vLLM does:

    pool = memory * gpu_memory_utilization - weights / tp - activation reserve

The activation reserve is what a profiling forward of one full step would hold: one
layer's widest live tensors for max_num_batched_tokens tokens (input, qkv, gate_up),
the fp32 logits of max_num_seqs rows, and a fixed NON_TORCH_RESERVE for the CUDA
context, cuBLAS/NCCL workspaces and captured graphs (~1 GiB in vLLM's start-up logs
for a single GPU). On cpu-local the engine sizes the pool directly (`--kv-cache-memory`,
default `pagedserve.config.default_kv_cache_memory()`), so the same is done here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import default_kv_cache_memory
from ..core.kv_plan import DraftKV, plan_kv_cache
from .cost_model import DTYPE_BYTES, CostModel
from .hardware import CPU_LOCAL

NON_TORCH_RESERVE = 2**30


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    memory_bytes: int
    weight_bytes: int  # per GPU
    activation_bytes: int
    kv_pool_bytes: int
    kv_bytes_per_token: float  # per GPU
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_memory(cost: CostModel, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None,
                draft: DraftKV | None = None) -> MemoryPlan:
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    m, tp, hw = cost.model, cost.tp, cost.hardware
    weights = cost.weight_bytes // tp
    kv_per_token = cost.kv_bytes_per_token / min(tp, m.num_kv_heads)
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    widest = m.hidden_size + (q + 2 * kv + 2 * m.intermediate_size) / tp
    activations = int(max_num_batched_tokens * widest * DTYPE_BYTES[cost.act_dtype]
                      + max_num_seqs * m.vocab_size * 4)
    if kv_cache_memory is not None:
        pool = kv_cache_memory
    elif hw.name == CPU_LOCAL:
        pool = default_kv_cache_memory()
    else:
        activations += NON_TORCH_RESERVE
        pool = int(hw.memory_bytes * gpu_memory_utilization) - weights - activations
    num_blocks = plan_kv_cache(pool, block_size, kv_per_token, draft).num_blocks
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache on {hw.name}: {hw.memory_bytes / 2**30:.1f} GiB x {gpu_memory_utilization} "
            f"utilisation - {weights / 2**30:.1f} GiB weights - {activations / 2**30:.2f} GiB activations "
            f"= {pool / 2**30:.2f} GiB; raise --tp or --gpu-memory-utilization, or use a smaller --dtype")
    return MemoryPlan(hw.memory_bytes, weights, activations, int(pool), kv_per_token, block_size, num_blocks)
