"""How many KV blocks fit on the simulated hardware: the CUDA engine's own plan
(core/memory_plan.py: pool = memory x utilisation - weights / tp - activation reserve,
a draft model's scratch included), priced with the cost model's dtypes. On cpu-local the
engine sizes the pool directly (`--kv-cache-memory`, default
`pagedserve.resolved_config.default_kv_cache_memory()`), so the same is done here.
"""
from __future__ import annotations

from ..resolved_config import default_kv_cache_memory
from ..core.kv_plan import DraftKV
from ..core.memory_plan import DeviceMemoryPlan, plan_device_memory
from .cost_model import DTYPE_BYTES, CostModel
from .hardware import CPU_LOCAL

MemoryPlan = DeviceMemoryPlan


def plan_memory(cost: CostModel, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None,
                draft: DraftKV | None = None) -> MemoryPlan:
    hw = cost.hardware
    if kv_cache_memory is None and hw.name == CPU_LOCAL:
        kv_cache_memory = default_kv_cache_memory()
    try:
        return plan_device_memory(
            cost.model, hw.memory_bytes, weight_dtype_bytes=cost.weight_dtype_bytes,
            head_dtype_bytes=cost.head_dtype_bytes, act_bytes=DTYPE_BYTES[cost.act_dtype],
            kv_dtype_bytes=DTYPE_BYTES[cost.kv_dtype], block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization, tp=cost.tp, kv_cache_memory=kv_cache_memory, draft=draft)
    except ValueError as e:
        raise ValueError(f"on {hw.name}: {e}") from None
