"""The CUDA engine's memory plan: core/memory_plan.py priced with the engine's own dtypes,
the same function `pagedserve sim` / `kv` price with the cost model's (sim/memory.py), so the
two agree for the same model, memory and limits (tests/test_gpu_path.py checks it)."""
from __future__ import annotations

from ..core.kv_plan import KV_CACHE_DTYPE_BYTES
from ..core.memory_plan import DeviceMemoryPlan, plan_device_memory
from ..model.config import ModelConfig
from ..model.device import DTYPE_BYTES
from ..resolved_config import ResolvedConfig


def kv_dtype_bytes(kv_cache_dtype: str, dtype: str) -> int:
    """Bytes per K/V element: "auto" stores the activations' dtype."""
    return DTYPE_BYTES[dtype] if kv_cache_dtype == "auto" else KV_CACHE_DTYPE_BYTES[kv_cache_dtype]


def weight_dtype_bytes(dtype: str, quantization: str) -> tuple[int, int]:
    """(decoder linear layers, LM head and embedding) bytes per parameter."""
    return (1 if quantization == "fp8" else DTYPE_BYTES[dtype]), DTYPE_BYTES[dtype]


def device_memory_plan(config: ResolvedConfig, model: ModelConfig, memory_bytes: int,
                       max_num_batched_tokens: int) -> DeviceMemoryPlan:
    """How `memory_bytes` of device memory splits for this engine config, whose scheduler
    takes `max_num_batched_tokens` per step."""
    dtype, kv = config.device.dtype, config.kv
    body, head = weight_dtype_bytes(dtype, config.load.quantization)
    return plan_device_memory(
        model, memory_bytes, weight_dtype_bytes=body, head_dtype_bytes=head, act_bytes=DTYPE_BYTES[dtype],
        kv_dtype_bytes=kv_dtype_bytes(kv.kv_cache_dtype, dtype), block_size=kv.block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=config.scheduling.max_num_seqs,
        gpu_memory_utilization=config.device.gpu_memory_utilization, kv_cache_memory=kv.kv_cache_memory)
