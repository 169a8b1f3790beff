"""How many KV blocks a memory budget holds, a draft model's share included: the one
sizing rule for the engine (bytes given) and the simulator (bytes left on a device)."""
from __future__ import annotations

from dataclasses import dataclass

# `--kv-cache-dtype`: bytes per stored K or V element. auto is the model's compute
# dtype (fp32 on this CPU path); fp16 and fp8 are converted to fp32 on read.
KV_CACHE_DTYPE_BYTES = {"auto": 4, "fp32": 4, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_CACHE_DTYPES = tuple(KV_CACHE_DTYPE_BYTES)


def check_kv_cache_dtype(value: str) -> str:
    if value not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
    return value


def scratch_blocks_per_seq(block_size: int, k: int) -> int:
    """Blocks that draft positions p .. p + k - 1 can touch, whatever p is."""
    return -(-(block_size - 1 + k) // block_size)


@dataclass(frozen=True, slots=True)
class DraftKV:
    """What a draft model adds to the KV cache."""

    # K/V bytes per token of the layers the draft runs.
    kv_bytes_per_token: float
    # A separate model keeps a cache of its own beside every pool block; a self-draft
    # ("self:N") is the target's first N layers and shares the target's blocks.
    own_cache: bool
    # Requests that may draft in one step, each with scratch blocks of its own.
    num_seqs: int
    num_speculative_tokens: int


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    # Target (and a separate draft's) K/V bytes of one pool block.
    bytes_per_block: float
    # Runner-private blocks past the pool (ids num_blocks and up) where drafts write
    # their unverified positions, and what they cost.
    num_scratch_blocks: int = 0
    scratch_bytes: float = 0


def plan_kv_cache(memory_bytes: float, block_size: int, kv_bytes_per_token: float,
                  draft: DraftKV | None = None) -> KVCachePlan:
    """The pool that fits `memory_bytes` once the draft's scratch is set aside;
    num_blocks may come out below 1, which the caller reports in its own terms."""
    bytes_per_block = kv_bytes_per_token * block_size
    num_scratch, scratch_bytes = 0, 0
    if draft is not None:
        if draft.own_cache:
            bytes_per_block += draft.kv_bytes_per_token * block_size
        num_scratch = draft.num_seqs * scratch_blocks_per_seq(block_size, draft.num_speculative_tokens)
        scratch_bytes = num_scratch * draft.kv_bytes_per_token * block_size
    num_blocks = max(int((memory_bytes - scratch_bytes) // bytes_per_block), 0)
    return KVCachePlan(num_blocks, block_size, bytes_per_block, num_scratch, scratch_bytes)
