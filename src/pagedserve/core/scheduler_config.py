"""Scheduler and KV-cache configuration, validated once at construction, and the defaults
every layer shares (one constant per default; the engine's options, the simulator, the
doctor and the Ray app import them).

Every invalid value raises ValueError naming the field and what it allows, so a
bad CLI flag or `LLM(...)` option fails before any request is accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

from .validation import is_int

POLICIES = ("chunked", "continuous", "static", "naive")
SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_BLOCK_SIZE = 1024
# Token slots per KV-cache block (vLLM's).
DEFAULT_BLOCK_SIZE = 16
# Requests running at once (vLLM's CPU default).
DEFAULT_MAX_NUM_SEQS = 128
# vLLM's GPU default of running requests: the simulator's and the doctor's GPU setups.
GPU_DEFAULT_MAX_NUM_SEQS = 256
# A fixed chunked-prefill budget per step where none is given and no target sizes steps:
# the scheduler's own default, the simulator's chunked policy (the seed's "~512 tokens")
# and what the Ray app's prediction prices an automatic budget as.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# Share of a GPU's memory for weights, activations and the KV pool (vLLM's).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Without chunked prefill a whole prompt must fit one step, so vLLM sizes the budget
# to the context length (and at least 2048) when chunking is off.
MIN_WHOLE_PROMPT_BUDGET = 2048
# Default token budget per step on a CPU. A step costs about 2 x params FLOPs per
# token; at ~90 GFLOP/s (fp32, 2 cores) and ~0.2 GFLOP/token for a 135M model, a
# 256-token step takes ~0.6 s. vLLM's GPU default (2048) would stall every decode
# for ~5 s behind a long prompt here; 256 keeps the worst inter-token gap well
# under a second while chunks stay large enough for efficient matmuls.
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
# vLLM's GPU token budget per step, its same 2,048: on a GPU a 2,048-token step still takes milliseconds.
GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = MIN_WHOLE_PROMPT_BUDGET


def whole_prompt_budget(max_model_len: int, max_num_seqs: int) -> int:
    """The default token budget of the policies that never chunk a prompt."""
    return max(max_model_len, MIN_WHOLE_PROMPT_BUDGET, max_num_seqs)


def check_seats_fit_budget(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Running decodes are scheduled before anything else, one token each; if they could
    outnumber the budget, the ones at the back would starve."""
    if max_num_seqs > max_num_batched_tokens:
        raise ValueError(f"max_num_seqs ({max_num_seqs}) must be <= max_num_batched_tokens "
                         f"({max_num_batched_tokens}) so every running decode fits one step")


def chunks_prefill(policy: str, enable_chunked_prefill: bool) -> bool:
    """Whether prompts are split across steps: only the chunked policy does, and only
    while the vLLM flag leaves chunking on."""
    return policy == "chunked" and enable_chunked_prefill


def _positive_int(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots each."""

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive_int("num_blocks", self.num_blocks)
        _positive_int("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        _flag("enable_prefix_caching", self.enable_prefix_caching)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """What one step may contain and how requests are chosen.

    `policy` selects the batching discipline for the scheduler study (see
    core/policies.py); `scheduling_policy` selects who goes first and who is
    preempted. `enable_chunked_prefill=False` turns the default "chunked" policy
    into "continuous" (the vLLM flag keeps its meaning); the other policies never
    chunk.
    """

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    policy: str = "chunked"

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        check_seats_fit_budget(self.max_num_seqs, self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _flag("enable_chunked_prefill", self.enable_chunked_prefill)
        threshold = self.long_prefill_token_threshold
        if not is_int(threshold) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0 = off), got {threshold!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")

    @property
    def chunked_prefill(self) -> bool:
        return chunks_prefill(self.policy, self.enable_chunked_prefill)
