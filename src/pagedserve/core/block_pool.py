"""Physical KV blocks: reference counts, an LRU free queue and the prefix-cache index.

A free block keeps its content hash until it is handed out again, so a later
request with the same prefix can revive it instead of recomputing it. The free
queue is least-recently-freed first: eviction takes from the front.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter

from .kv_events import KVEventLog


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Set only while the block is registered in the prefix-cache index.
    block_hash: bytes | None = None


BLOCK_ID = attrgetter("block_id")
_REF_CNT = attrgetter("ref_cnt")


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict is a C-implemented doubly linked list: O(1) append, pop from
        # the front and removal from the middle (a prefix hit on a free block).
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        # Attached while someone outside watches the index (core/kv_events.py).
        self.events: KVEventLog | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    # The two array views below iterate in C (map + attrgetter), so a watcher of the
    # pool pays no Python bytecode per block.
    def ref_counts(self) -> array:
        """Every block's reference count, indexed by block id (array of C int)."""
        return array("i", map(_REF_CNT, self.blocks))

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix-cache index (the state a new watcher starts from)."""
        return list(self._cached)

    def cached_block_ids(self) -> array:
        """Ids of the blocks indexed in the prefix cache, in use or free."""
        return array("i", map(BLOCK_ID, self._cached.values()))

    def take(self, count: int) -> list[Block]:
        """Hand out `count` blocks from the front of the free queue, evicting their hashes.

        The caller has checked that `count <= num_free`.
        """
        taken = []
        popitem = self._free.popitem
        for _ in range(count):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def acquire(self, blocks: Iterable[Block]) -> None:
        """Add a reference to blocks that already hold wanted content (hits, forks)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue
        in the order given, so pass a request's blocks tail first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def register(self, block: Block, block_hash: bytes) -> None:
        """Index a just-filled block under its hash, unless an equal block is indexed
        already (two requests computed the same prefix at once); the duplicate then
        stays anonymous and is reused first-come when freed."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
            if self.events is not None:
                self.events.stored(block_hash)

    def check_invariants(self) -> None:
        """Raise AssertionError if the free queue, ref counts or index disagree."""
        free_ids = set(self._free)
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in free_ids):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                    f"{'in' if block.block_id in free_ids else 'not in'} the free queue"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} carries a hash the index does not map to it")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"index maps a hash to block {block.block_id}, which carries another")
        if len(self._free) + sum(1 for b in self.blocks if b.ref_cnt > 0) != self.num_blocks:
            raise AssertionError("free + used != total")
