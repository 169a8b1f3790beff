"""Block tables per request on top of the block pool: allocation, prefix hits,
copy-on-write forks and accounting.

Every request that holds blocks has one row: its block table, how many of those
blocks are indexed in the prefix cache, and how many token slots are (or after
this step's forward will be) filled. Between steps a table holds exactly
ceil(stored tokens / block_size) blocks, so only its last block can be partial.
"""
from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .block_hash import extend_block_hashes
from .block_pool import BLOCK_ID, Block, BlockPool
from .scheduler_config import CacheConfig
from .kv_cache import NO_CHANGE, NO_HIT, Allocation, BlockMap, PrefixHit
from .kv_events import KVEventLog
from .request import Request


@dataclass(slots=True)
class _Row:
    request: Request
    blocks: list[Block]
    # Blocks [0, num_hashed_blocks) have had their hash offered to the index.
    num_hashed_blocks: int
    num_stored_tokens: int


class KVCacheManager:
    """The paged layout's KVCache (core/kv_cache.py)."""

    # n > 1 children and beams share their parent's blocks (copy-on-write).
    supports_forks = True

    # A block-hash index that KV events (core/kv_events.py) can stream.
    indexes_prefixes = True

    # The pool's tensors are allocated whole before the first request.
    peak_committed_bytes = None

    def __init__(self, config: CacheConfig):
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks)
        self._rows: dict[str, _Row] = {}
        # In tokens, counted once per admission that used a lookup (vLLM's meaning).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (free cached blocks count as free)."""
        return self.pool.num_used / self.num_blocks

    def waste(self) -> float:
        """Internal fragmentation: empty slots in blocks in use, over all slots in use.

        Only a table's last block can be partly filled; a partial block shared by
        forked siblings is one physical block and is counted once.
        """
        used = self.pool.num_used
        if used == 0:
            return 0.0
        bs = self.block_size
        tail_fill: dict[int, int] = {}
        for row in self._rows.values():
            if row.blocks:
                block_id = row.blocks[-1].block_id
                fill = row.num_stored_tokens - (len(row.blocks) - 1) * bs
                if fill > tail_fill.get(block_id, 0):
                    tail_fill[block_id] = fill
        return sum(bs - fill for fill in tail_fill.values()) / (used * bs)

    def fit_error(self, num_tokens: int) -> str | None:
        """Why a request of num_tokens could never run in this pool; None if it could."""
        need = -(-num_tokens // self.block_size)
        if need > self.num_blocks:
            return f"needs {need} KV blocks of {self.block_size}; the pool has {self.num_blocks}"
        return None

    def has_blocks(self, request: Request) -> bool:
        return request.request_id in self._rows

    def block_ids(self, request: Request) -> tuple[int, ...]:
        row = self._rows.get(request.request_id)
        return tuple(b.block_id for b in row.blocks) if row is not None else ()

    def block_tables(self) -> dict[str, tuple[array, int]]:
        """Every table as (block ids as an array of C int, stored tokens), by request id;
        built in C per table, for observers of the whole pool."""
        return {rid: (array("i", map(BLOCK_ID, row.blocks)), row.num_stored_tokens) for rid, row in self._rows.items()}

    def block_map(self) -> BlockMap:
        return BlockMap(self.pool.ref_counts(), self.pool.cached_block_ids())

    def cached_hashes(self) -> list[bytes]:
        return self.pool.cached_hashes()

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """The longest run of leading full blocks already in the cache, for a request
        that holds no blocks. Capped below num_tokens so at least one token is computed
        (its logits give the next token). No side effects beyond hashing the request."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return NO_HIT
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks == 0:
            return NO_HIT
        hashes = request.block_hashes
        if len(hashes) < max_blocks:
            extend_block_hashes(hashes, request.all_token_ids, bs, max_blocks, request.cache_salt, request.lora_id,
                                request.images)
        hit = []
        lookup = self.pool.lookup
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hit.append(block)
        return PrefixHit(tuple(hit), len(hit) * bs) if hit else NO_HIT

    # -- changes -------------------------------------------------------------------

    def begin_step(self) -> None:
        """Called at the start of every schedule(); the block pool keeps no outside reading."""

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> Allocation | None:
        """Make room for `num_new_tokens` tokens after the computed ones (and after
        `prefix_hit`, for an admission). Returns None and changes nothing when the
        pool cannot cover it.

        Writing into a partly filled block that another table also holds gets a
        private copy first (copy-on-write); full blocks are never written, so never
        copied.
        """
        bs = self.block_size
        row = self._rows.get(request.request_id)
        if row is not None and prefix_hit is None:
            # The common case, a decode or chunk that fits the blocks it holds and
            # writes no shared block: nothing to hand out.
            start = request.num_computed_tokens
            end = start + num_new_tokens
            blocks = row.blocks
            if end <= len(blocks) * bs and (start % bs == 0 or blocks[start // bs].ref_cnt == 1):
                if end > row.num_stored_tokens:
                    row.num_stored_tokens = end
                return NO_CHANGE
        blocks = row.blocks if row is not None else []
        hit_blocks = prefix_hit.blocks if prefix_hit is not None else ()
        start = request.num_computed_tokens + (prefix_hit.num_tokens if prefix_hit is not None else 0)
        end = start + num_new_tokens
        num_new_blocks = max(0, -(-end // bs) - len(blocks) - len(hit_blocks))
        cow_index = start // bs
        if start % bs == 0 or cow_index >= len(blocks) or blocks[cow_index].ref_cnt == 1:
            cow_index = -1
        # A hit on a free (cached) block takes it out of the free queue too.
        needed = num_new_blocks + (cow_index >= 0) + sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free:
            return None
        if row is None:
            row = _Row(request, blocks, len(hit_blocks), 0)
            self._rows[request.request_id] = row
        if end > row.num_stored_tokens:
            row.num_stored_tokens = end
        if prefix_hit is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix_hit.num_tokens
        if hit_blocks:
            self.pool.acquire(hit_blocks)
            blocks.extend(hit_blocks)
        copies: tuple[tuple[int, int], ...] = ()
        if cow_index >= 0:
            shared = blocks[cow_index]
            private = self.pool.take(1)[0]
            blocks[cow_index] = private
            self.pool.release((shared,))
            copies = ((shared.block_id, private.block_id),)
        new_blocks = self.pool.take(num_new_blocks)
        blocks.extend(new_blocks)
        return Allocation(tuple(b.block_id for b in new_blocks), copies)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once its first `num_tokens` tokens
        are in the cache. Called when those tokens are scheduled: a request admitted
        later in the same step may hit them, which is safe because every attention
        layer writes the step's K/V before it reads the cache."""
        if not self.enable_prefix_caching:
            return
        row = self._rows[request.request_id]
        num_full = num_tokens // self.block_size
        if num_full <= row.num_hashed_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, num_full, request.cache_salt,
                                request.lora_id, request.images)
        register = self.pool.register
        blocks = row.blocks
        for i in range(row.num_hashed_blocks, num_full):
            register(blocks[i], hashes[i])
        row.num_hashed_blocks = num_full

    def rollback(self, request: Request) -> bool:
        """Forget the slots past num_computed_tokens (rejected draft tokens): the
        blocks no longer needed go back to the pool. Returns True if any did.

        Rejected tokens never reach the prefix cache: cache_blocks only ever indexes
        verified tokens, and a freed block that was never indexed carries no hash.
        """
        row = self._rows[request.request_id]
        keep = request.num_computed_tokens
        if keep >= row.num_stored_tokens:
            return False
        row.num_stored_tokens = keep
        num_blocks = -(-keep // self.block_size)
        surplus = row.blocks[num_blocks:]
        if not surplus:
            return False
        del row.blocks[num_blocks:]
        self.pool.release(reversed(surplus))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's table, sharing every block by reference count."""
        prow = self._rows[parent.request_id]
        self.pool.acquire(prow.blocks)
        num_hashed = min(prow.num_hashed_blocks, child.num_computed_tokens // self.block_size)
        self._rows[child.request_id] = _Row(child, list(prow.blocks), num_hashed, child.num_computed_tokens)

    def repoint(self, moves: Sequence[tuple[Request, Request]]) -> None:
        """Beam search: for each (member, source), the member's table becomes a share of the
        source's table as it was before this call (sources may themselves move); the blocks
        the member held are dropped. No block is copied: a partly filled last block now
        shared gets its private copy when a member next writes it (allocate_slots)."""
        pairs = [(self._rows[m.request_id], self._rows[s.request_id]) for m, s in moves]
        taken = [(list(src.blocks), src.num_hashed_blocks, src.num_stored_tokens) for _, src in pairs]
        # Every new reference before any old one goes, so a block both kept and dropped never
        # passes through the free queue.
        for blocks, _, _ in taken:
            self.pool.acquire(blocks)
        dropped = [row.blocks for row, _ in pairs]
        for (row, _), (blocks, hashed, stored) in zip(pairs, taken):
            row.blocks, row.num_hashed_blocks, row.num_stored_tokens = blocks, hashed, stored
        for blocks in dropped:
            self.pool.release(reversed(blocks))

    def free(self, request: Request) -> None:
        """Return every block of the request; the tail goes first so it is evicted first."""
        row = self._rows.pop(request.request_id, None)
        if row is not None:
            self.pool.release(reversed(row.blocks))

    # -- the index's observers -----------------------------------------------------------

    def record_events(self, on: bool) -> None:
        if not on:
            self.pool.events = None
        elif self.pool.events is None:
            self.pool.events = KVEventLog()

    def drain_events(self) -> list[tuple[str, bytes]]:
        log = self.pool.events
        return log.drain() if log is not None and log.events else []

    def install_cached_prefix(self, block_hashes: Sequence[bytes]) -> bool:
        """Free cached blocks at the back of the eviction queue; hashes indexed already
        keep their blocks, not installed twice."""
        pool = self.pool
        present = [b for h in block_hashes if (b := pool.lookup(h)) is not None]
        missing = [h for h in block_hashes if pool.lookup(h) is None]
        held = [b for b in present if b.ref_cnt == 0]
        if len(missing) > pool.num_free - len(held):
            return False
        pool.acquire(present)  # keep them from being evicted by the take below
        blocks = pool.take(len(missing))
        for block, h in zip(blocks, missing):
            pool.register(block, h)
        pool.release(reversed(blocks + present))
        return True

    # -- checks --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless ref counts equal table membership, free + used =
        total, tables are exactly as long as their stored tokens need, and indexed
        blocks carry their owner's chained hash."""
        self.pool.check_invariants()
        bs = self.block_size
        holders = Counter(b.block_id for row in self._rows.values() for b in row.blocks)
        for block in self.pool.blocks:
            if block.ref_cnt != holders.get(block.block_id, 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} tables"
                )
        for request_id, row in self._rows.items():
            request = row.request
            if len({b.block_id for b in row.blocks}) != len(row.blocks):
                raise AssertionError(f"request {request_id} holds a block twice")
            if len(row.blocks) != -(-row.num_stored_tokens // bs):
                raise AssertionError(
                    f"request {request_id}: {len(row.blocks)} blocks for {row.num_stored_tokens} stored tokens"
                )
            if row.num_stored_tokens < request.num_computed_tokens:
                raise AssertionError(f"request {request_id}: computed tokens without slots")
            # The scheduler relies on this to skip cache_blocks when no block filled up;
            # blocks filled only by unverified draft tokens must stay unindexed.
            if self.enable_prefix_caching and row.num_hashed_blocks != request.num_verified_tokens // bs:
                raise AssertionError(
                    f"request {request_id}: {row.num_hashed_blocks} blocks hashed, "
                    f"{request.num_verified_tokens // bs} full of verified tokens"
                )
            for i in range(row.num_hashed_blocks):
                block_hash = row.blocks[i].block_hash
                if block_hash is not None and block_hash != request.block_hashes[i]:
                    raise AssertionError(f"request {request_id}: block {i} indexed under another prefix's hash")
