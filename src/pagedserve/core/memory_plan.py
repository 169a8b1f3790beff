"""How an accelerator's memory is split between weights, activations and the KV pool: the one
rule the CUDA engine allocates by and `pagedserve sim` / `doctor` model (sim/memory.py), as vLLM:

    pool = memory * gpu_memory_utilization - weights / tp - activation reserve

The activation reserve is what a profiling forward of one full step would hold: one layer's
widest live tensors for max_num_batched_tokens tokens (input, qkv, gate_up), the fp32 logits
of max_num_seqs rows, and NON_TORCH_RESERVE for the CUDA context, cuBLAS workspaces and
captured graphs (~1 GiB in vLLM's start-up logs for a single GPU).

Pure arithmetic over a model's shape (any object with ModelConfig's fields), so the engine,
which has the real model, and the simulator, which has only its config, compute the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .kv_plan import DraftKV, plan_kv_cache

NON_TORCH_RESERVE = 2**30


class ModelShape(Protocol):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool

    @property
    def num_params(self) -> int: ...


def weight_bytes(model: ModelShape, dtype_bytes: float, head_dtype_bytes: float | None = None) -> int:
    """Bytes of the weights held in memory: the decoder's linear layers at dtype_bytes per
    parameter, the LM head and an untied embedding at head_dtype_bytes (FP8 checkpoints keep
    both in BF16: the head is on their ignore list, the embedding is no linear layer)."""
    head = model.vocab_size * model.hidden_size
    held_head = head + (0 if model.tie_word_embeddings else head)
    hb = dtype_bytes if head_dtype_bytes is None else head_dtype_bytes
    return int((model.num_params - head) * dtype_bytes + held_head * hb)


def activation_bytes(model: ModelShape, max_num_batched_tokens: int, max_num_seqs: int, act_bytes: float,
                     tp: int = 1) -> int:
    """One full step's widest live tensors and the sampled rows' fp32 logits (no fixed reserve)."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    widest = model.hidden_size + (q + 2 * kv + 2 * model.intermediate_size) / tp
    return int(max_num_batched_tokens * widest * act_bytes + max_num_seqs * model.vocab_size * 4)


@dataclass(frozen=True, slots=True)
class DeviceMemoryPlan:
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


def plan_device_memory(model: ModelShape, memory_bytes: int, *, weight_dtype_bytes: float,
                       head_dtype_bytes: float, act_bytes: float, kv_dtype_bytes: float, block_size: int,
                       max_num_batched_tokens: int, max_num_seqs: int, gpu_memory_utilization: float = 0.9,
                       tp: int = 1, kv_cache_memory: int | None = None, draft: DraftKV | None = None,
                       reserve: int = NON_TORCH_RESERVE) -> DeviceMemoryPlan:
    """The plan for `memory_bytes` of device memory; `kv_cache_memory` fixes the pool instead
    (reserve 0 is for a host whose pool is sized directly). ValueError if no block fits."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    weights = weight_bytes(model, weight_dtype_bytes, head_dtype_bytes) // tp
    # A KV head replicated across tp > num_kv_heads ranks is held by each of them.
    kv_per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim * kv_dtype_bytes \
        / min(tp, model.num_kv_heads)
    activations = activation_bytes(model, max_num_batched_tokens, max_num_seqs, act_bytes, tp)
    if kv_cache_memory is not None:
        pool = kv_cache_memory
    else:
        activations += reserve
        pool = int(memory_bytes * gpu_memory_utilization) - weights - activations
    num_blocks = plan_kv_cache(pool, block_size, kv_per_token, draft).num_blocks
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {memory_bytes / 2**30:.1f} GiB x {gpu_memory_utilization} "
            f"utilisation - {weights / 2**30:.1f} GiB weights - {activations / 2**30:.2f} GiB activations "
            f"= {pool / 2**30:.2f} GiB; raise --tp or --gpu-memory-utilization, or use a smaller --dtype")
    return DeviceMemoryPlan(memory_bytes, weights, activations, int(pool), kv_per_token, block_size, num_blocks)
