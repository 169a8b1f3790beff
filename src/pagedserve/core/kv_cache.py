"""The contract between the scheduler (and every observer of the KV cache) and a KV layout.

Two layouts implement it: the paged pool (core/kv_cache_manager.py) and the contiguous
regions (core/contiguous_kv.py). Nothing outside them may reach past this protocol into a
layout's own structures: a capability one layout lacks is stated here, as a flag or as a
None answer, so a reader asks instead of probing, and a layout that lacks it answers
truthfully (an empty index) or refuses loudly where no truthful answer exists.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .block_pool import Block
from .request import Request


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """Leading full blocks whose KV a new request can reuse; num_tokens = len(blocks) * block_size."""

    blocks: tuple[Block, ...]
    num_tokens: int


@dataclass(slots=True, frozen=True)
class Allocation:
    """What one successful allocate_slots call changed in a table."""

    new_block_ids: tuple[int, ...]
    # (src, dst): the runner copies block src into dst before the forward; dst has
    # replaced src in the table.
    copies: tuple[tuple[int, int], ...]


NO_HIT = PrefixHit((), 0)
NO_CHANGE = Allocation((), ())


@dataclass(slots=True, frozen=True)
class BlockMap:
    """The pool drawn block by block (the live dashboard), as arrays of C int."""

    # Every block's reference count, indexed by block id.
    ref_counts: array
    # Ids of the blocks indexed in the prefix cache, in use or free.
    cached_block_ids: array


class KVCache(Protocol):
    """Block tables per request over some KV memory, in block units either way: a layout
    that is not made of blocks reports its budget in block equivalents, so observers of
    either read the same figures."""

    # -- what the layout can do ---------------------------------------------------------

    @property
    def supports_forks(self) -> bool:
        """Whether n > 1 children and beams can share their parent's blocks (fork, repoint)."""
        ...

    @property
    def indexes_prefixes(self) -> bool:
        """Whether there is a block-hash index: prefix hits, installed prefixes and KV events.
        Without one, lookups miss and the index reads empty."""
        ...

    # -- usage ----------------------------------------------------------------------------

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of the memory held by requests."""
        ...

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens of admissions that looked the prefix cache up (vLLM's meaning)."""
        ...

    @property
    def prefix_cache_hits(self) -> int: ...

    def waste(self) -> float:
        """Held memory that stores no token, over held memory."""
        ...

    @property
    def peak_committed_bytes(self) -> int | None:
        """The most memory the layout has had committed at once, where it commits memory as
        tokens arrive; None where its memory is committed whole at start-up (the runner's
        tensors are then the figure)."""
        ...

    def fit_error(self, num_tokens: int) -> str | None:
        """Why a request of num_tokens could never run here; None if it could."""
        ...

    # -- tables ---------------------------------------------------------------------------

    def has_blocks(self, request: Request) -> bool: ...

    def block_ids(self, request: Request) -> tuple[int, ...]: ...

    def block_tables(self) -> dict[str, tuple[array, int]]:
        """Every table as (block ids as an array of C int, stored tokens), by request id."""
        ...

    def block_map(self) -> BlockMap | None:
        """None where blocks are not pooled, shareable units (nothing to draw per block)."""
        ...

    # -- changes --------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Called at the start of every schedule(), when every scheduled write has happened."""
        ...

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Reusable leading blocks for a request that holds none; no side effects."""
        ...

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> Allocation | None:
        """Room for num_new_tokens after the computed ones (and after `prefix_hit`, for an
        admission); None, with nothing changed, when it does not fit."""
        ...

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once its first num_tokens are cached."""
        ...

    def rollback(self, request: Request) -> bool:
        """Forget the slots past num_computed_tokens; True if the table lost a block."""
        ...

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's table (only where supports_forks)."""
        ...

    def repoint(self, moves: Sequence[tuple[Request, Request]]) -> None:
        """Beam search: each (member, source) gives the member a share of the source's table
        as it was before the call, dropping the member's own (only where supports_forks)."""
        ...

    def free(self, request: Request) -> None: ...

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is off."""
        ...

    # -- the prefix-cache index, for observers outside the engine -------------------------

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the index now (the state a new watcher starts from)."""
        ...

    def record_events(self, on: bool) -> None:
        """Start or stop logging the index's changes; starting again keeps what is pending."""
        ...

    def drain_events(self) -> list[tuple[str, bytes]]:
        """The index changes since the last drain, in order, as (core/kv_events kind, hash)."""
        ...

    def install_cached_prefix(self, block_hashes: Sequence[bytes]) -> bool:
        """Put a prefix computed elsewhere into the index as free cached blocks (the
        simulator's transfer between instances); False, with nothing changed, when the
        memory has no room. Only where indexes_prefixes."""
        ...
