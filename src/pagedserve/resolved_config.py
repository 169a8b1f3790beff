"""What `EngineConfig.resolve` returns: the options checked together, every default filled,
and split into the parts the engine's modules take (each module reads only its own).

Nothing here checks which options go together or works a default out: resolve has done
both (docs/configuration.md). The one value a part fills later is the whole-prompt token
budget of the policies that never chunk, which is the context length, known once the
model is (`SchedulingConfig.scheduler_config`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .core.kv_connector import KVTransferConfig
from .core.kv_disk_index import KVOffloadConfig
from .core.scheduler_config import CacheConfig, SchedulerConfig, whole_prompt_budget
from .core.step_budget import LatencyTarget
from .spec_decode.spec_config import SpeculativeConfig


@dataclass(frozen=True)
class LoadConfig:
    """Which weights are read and how they are held."""

    model: str | None
    quantization: str  # concrete: none, q8_0, q4_0, q4_1, gguf or fp8
    gguf_weights: str  # blocks or dense
    max_model_len: int | None  # the user's limit; the model's own context caps it

    @property
    def load_quantization(self) -> str:
        """What load_model builds: fp8 is made from the unquantised weights when the model is placed."""
        return "none" if self.quantization == "fp8" else self.quantization

    def context_length(self, model_max: int) -> int:
        """The engine's max_model_len: the user's limit within the model's `model_max` positions."""
        return min(self.max_model_len or model_max, model_max)


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model computes and with which kernels."""

    name: str  # cpu or cuda
    kernels: str  # native or torch
    dtype: str  # float32, bfloat16 or float16
    attention_backend: str | None  # None: the kernels' and layout's default (attention/selector.py)
    enforce_eager: bool
    max_cudagraph_batch: int | None
    gpu_memory_utilization: float

    @property
    def on_gpu(self) -> bool:
        return self.name != "cpu"

    @property
    def decode_graphs(self) -> str | None:
        """The runner's decode graphs: CUDA graphs on a GPU unless eager was asked for."""
        return "cuda" if self.on_gpu and not self.enforce_eager else None


@dataclass(frozen=True)
class KVConfig:
    """The KV cache: its layout, element type, block size and memory, and its disk tier."""

    block_size: int
    kv_cache_memory: int | None  # on cpu always set (default_kv_cache_memory); None on cuda: the memory plan's pool
    kv_cache_dtype: str  # auto (the model's dtype), fp32, fp16, fp8_e4m3 or fp8_e5m2
    kv_layout: str  # paged or contiguous
    enable_prefix_caching: bool
    offload: KVOffloadConfig | None = None  # the disk tier (--kv-offload-dir), paged layout only

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(num_blocks=num_blocks, block_size=self.block_size,
                           enable_prefix_caching=self.enable_prefix_caching)


@dataclass(frozen=True)
class SchedulingConfig:
    """What a step may hold and how it is sized: the token budget decided once.

    `max_num_batched_tokens` is a fixed budget per step (the user's, or cuda's default);
    None when steps are sized otherwise. `latency_target` sizes each step (given, or the
    automatic one) under `step_token_cap`. `step_token_cap` is the most tokens a step may
    hold: the fixed budget, or the target's cap; None for the policies that never chunk,
    whose budget is a whole prompt (the context length, `scheduler_config`)."""

    max_num_seqs: int
    max_num_batched_tokens: int | None
    step_token_cap: int | None
    latency_target: LatencyTarget | None
    itl_target_ms: float | None
    ttft_target_ms: float | None
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    scheduling_policy: str
    policy: str

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits for an engine whose context is `max_model_len` tokens."""
        return SchedulerConfig(
            max_num_batched_tokens=self.step_token_cap or whole_prompt_budget(max_model_len, self.max_num_seqs),
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
            policy=self.policy,
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the tensor-parallel ranks are laid out and started, and the threads of each."""

    tensor_parallel_size: int
    nnodes: int
    node_rank: int
    distributed_init_method: str | None
    distributed_executor_backend: str
    num_threads: int | None  # per rank; None: the host's cores shared by its ranks (rank_num_threads)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def rank_num_threads(self) -> int:
        """Torch threads for one rank: the option, else this host's cores shared by its ranks
        (read where the rank runs, which may be another host)."""
        return self.num_threads or max(1, default_num_threads() // self.ranks_per_node)


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool
    lora_modules: tuple[tuple[str, str], ...]  # (name, path) loaded at start
    max_loras: int
    max_lora_rank: int


@dataclass(frozen=True)
class ServingConfig:
    """What requests the engine takes and what runs beside the model for them."""

    task: str  # auto, generate or embed
    pooling_type: str
    seed: int
    speculative_config: SpeculativeConfig | None
    kv_transfer_config: KVTransferConfig | None


@dataclass(frozen=True)
class ResolvedConfig:
    """An engine's configuration, resolved: each part for the modules that read it."""

    load: LoadConfig
    device: DeviceConfig
    kv: KVConfig
    scheduling: SchedulingConfig
    parallel: ParallelConfig
    lora: LoRAConfig
    serving: ServingConfig


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_kv_cache_memory() -> int:
    """A quarter of the memory available now, capped at 2 GiB. For the 135M default
    model (46 KB of fp32 K/V per token) 2 GiB holds ~45k tokens, enough for 64
    concurrent 700-token sequences; the whole pool is committed at start-up (on a
    thread beside it), so a larger default would only take memory and CPU from a start.
    Pass kv_cache_memory for more."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return int(min(available // 4, 2 << 30))
