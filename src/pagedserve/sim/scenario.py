"""One serving setup (model, hardware, dtypes, memory, scheduler limits) turned into a cost
model, a KV pool and per-policy simulator configs: shared by `sim` and `doctor`."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.scheduler_config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GPU_DEFAULT_MAX_NUM_SEQS,
    MIN_WHOLE_PROMPT_BUDGET,
    whole_prompt_budget,
)
from ..core.contiguous_kv import PAGE_SIZE, ContiguousLayout, check_kv_layout, plan_contiguous
from ..model.config import ModelConfig
from .cost_model import GGUF_DTYPE, CostModel
from .hardware import Hardware, get_hardware
from .memory import MemoryPlan, plan_memory
from .models import load_model, stored_weights
from .simulator import SimConfig


@dataclass(frozen=True, slots=True)
class Scenario:
    model: ModelConfig
    hardware: Hardware
    cost: CostModel
    plan: MemoryPlan
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool

    def budget(self, policy: str) -> int:
        if policy == "chunked":
            return self.max_num_batched_tokens
        return whole_prompt_budget(self.max_model_len, self.max_num_seqs)

    def target_cap(self) -> int:
        """The hard cap under a latency target: the target, not the cap, sizes steps, so the
        cap is large enough for a wave of prompts in one step (vLLM's 2,048)."""
        return max(self.max_num_batched_tokens, MIN_WHOLE_PROMPT_BUDGET)

    def contiguous_layout(self, page_size: int = PAGE_SIZE) -> ContiguousLayout:
        """The contiguous KV layout over the same memory: a region per seat, each layer's K
        and V (on one GPU's share of the KV heads) committed page by page."""
        streams = 2 * self.model.num_layers
        return plan_contiguous(self.plan.kv_pool_bytes, self.max_model_len, self.max_num_seqs, self.block_size,
                               round(self.plan.kv_bytes_per_token / streams), streams, page_size)

    def sim_config(self, policy: str, concurrency: int | None = None, request_rate: float = math.inf,
                   seed: int = 0, itl_target_ms: float | None = None,
                   ttft_target_ms: float | None = None, kv_layout: str = "paged",
                   page_size: int = PAGE_SIZE, itl_ratio: float | None = None,
                   scheduling_policy: str = "fcfs") -> SimConfig:
        targeted = itl_target_ms is not None or ttft_target_ms is not None or itl_ratio is not None
        contiguous = self.contiguous_layout(page_size) if check_kv_layout(kv_layout) == "contiguous" else None
        return SimConfig(policy=policy, num_blocks=self.plan.num_blocks, block_size=self.block_size,
                         max_num_seqs=self.max_num_seqs,
                         max_num_batched_tokens=self.target_cap() if targeted else self.budget(policy),
                         max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
                         concurrency=concurrency, request_rate=request_rate, seed=seed,
                         itl_target_ms=itl_target_ms, ttft_target_ms=ttft_target_ms, itl_ratio=itl_ratio,
                         contiguous=contiguous, scheduling_policy=scheduling_policy)


def build_scenario(model: str, hardware: str, dtype: str = "bf16", kv_cache_dtype: str | None = None,
                   tp: int = 1, block_size: int = DEFAULT_BLOCK_SIZE, max_num_seqs: int = GPU_DEFAULT_MAX_NUM_SEQS,
                   max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                   gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, kv_cache_memory: int | None = None,
                   enable_prefix_caching: bool = True, clamp_max_model_len: bool = True) -> Scenario:
    """max_model_len defaults to the model's, clamped to what the pool holds (vLLM refuses to
    start otherwise; `doctor` passes clamp_max_model_len=False to report that instead).
    dtype "gguf" prices a .gguf model's weights at the bytes its own types take."""
    m = load_model(model)
    # "gguf": the file's own bytes per weight, multiplied at the 16-bit rate (dequantised as read).
    stored = stored_weights(model) if dtype == GGUF_DTYPE else None
    cost = CostModel(m, get_hardware(hardware), "bf16" if stored else dtype, kv_cache_dtype, tp, stored)
    budget = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
    plan = plan_memory(cost, block_size, budget, max_num_seqs, gpu_memory_utilization, kv_cache_memory)
    mml = max_model_len or m.max_position_embeddings
    if clamp_max_model_len:
        mml = min(mml, plan.num_tokens)
    return Scenario(m, cost.hardware, cost, plan, mml, max_num_seqs, budget, block_size, enable_prefix_caching)
