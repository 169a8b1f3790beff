"""Accounting of the contiguous KV layout (vAttention on a CPU): one virtual region per
running request, committed by the operating system page by page as its tokens are written.

A region holds `region_tokens` tokens of every layer's K and V: layers x 2 "streams",
each a contiguous [region_tokens, kv_heads, head_dim] slice of one anonymous mapping that
reserves no memory. Writing token t of a stream commits the page it falls in, so a request
with w tokens written holds streams x ceil(w x stream_bytes / page) pages, whatever its
max_model_len. The pages stay committed until the request ends; then the worker gives
them back (madvise DONTNEED) and the region returns to a pool for the next request.

The scheduler's decisions compare committed bytes with the budget (--kv-cache-memory):
the figure is the operating system's count of the pages written up to the last reading
(every SYNC_EVERY_STEPS steps the OS is asked about the pages written since, each page
once) plus the pages the rows scheduled since will touch, which no reading can show yet
because their tokens are written by the coming forward. So admission and growth never
take the cache past the budget, and a drift between the arithmetic and the OS (huge
pages, say) is caught at the next reading.

The runner still gets block ids so its tables, slot mapping and kernels need no second
code path: region r's blocks are r x blocks_per_region + 0, 1, 2, ..., consecutive in
memory, so a sequence's K/V is one contiguous view. There is no page sharing, hence no
prefix caching and no n > 1 (see docs/kv-layouts.md).
"""
from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .scheduler_config import CacheConfig
from .kv_cache import NO_CHANGE, NO_HIT, Allocation, PrefixHit
from .request import Request

KV_LAYOUTS = ("paged", "contiguous")
# The attention backends that read a sequence's blocks as one run: right only under the
# contiguous layout (attention/contiguous_backend.py names its classes so).
CONTIGUOUS_BACKENDS = ("contiguous", "contiguous-native")
PAGE_SIZE = 4096
# How often the OS is asked about the pages written since the last reading (schedule()
# calls). Each page is read once, after its first write: one pagemap read per stream per
# request that grew, a few pages each.
SYNC_EVERY_STEPS = 16


def check_kv_layout(value: str) -> str:
    if value not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ContiguousLayout:
    num_regions: int
    # Tokens one region holds: max_model_len rounded up to whole blocks and whole pages.
    region_tokens: int
    block_size: int
    # One token of one layer's K (or V).
    stream_bytes_per_token: int
    # layers x 2 (K and V)
    num_streams: int
    page_size: int
    # The budget (--kv-cache-memory).
    memory_bytes: int

    @property
    def blocks_per_region(self) -> int:
        return self.region_tokens // self.block_size

    @property
    def budget_pages(self) -> int:
        return self.memory_bytes // self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.stream_bytes_per_token * self.num_streams

    def stream_pages(self, tokens: int) -> int:
        """Pages of one stream that tokens 0 .. tokens - 1 touch."""
        return -(-tokens * self.stream_bytes_per_token // self.page_size)

    def pages_for(self, tokens: int) -> int:
        """Pages committed once tokens 0 .. tokens - 1 are written in every stream."""
        return self.num_streams * self.stream_pages(tokens)


def plan_contiguous(memory_bytes: int, max_model_len: int, num_regions: int, block_size: int,
                    stream_bytes_per_token: int, num_streams: int, page_size: int = PAGE_SIZE) -> ContiguousLayout:
    """A region of at least max_model_len tokens whose every stream starts on a page."""
    # A stream's region must be a whole number of pages and of blocks.
    tokens_per_page_run = page_size // _gcd(page_size, stream_bytes_per_token)
    unit = tokens_per_page_run * block_size // _gcd(tokens_per_page_run, block_size)
    region_tokens = -(-max_model_len // unit) * unit
    return ContiguousLayout(num_regions, region_tokens, block_size, stream_bytes_per_token, num_streams,
                            page_size, memory_bytes)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


class RegionMemory(Protocol):
    """The OS side, implemented in worker/ (torch-free here)."""

    def committed_pages(self, extents: list[tuple[int, int, int]]) -> list[int]:
        """For each (region, first page, end page): how many of those pages of the region's
        streams (all of them) the OS has committed, read from the OS."""
        ...

    def release(self, region: int) -> None:
        """Give the region's pages back to the OS; it reads as zeros after."""
        ...


@dataclass(slots=True)
class _Region:
    request: Request
    index: int
    num_stored_tokens: int
    # High-water mark of written tokens since the region was taken: what the OS holds.
    num_written_tokens: int = 0
    # Tokens whose pages the OS has been asked about, and what it answered (all streams).
    synced_tokens: int = 0
    synced_pages: int = 0


class ContiguousKVCacheManager:
    """The contiguous layout's KVCache (core/kv_cache.py): regions instead of pooled blocks.

    num_blocks / num_free_blocks report the budget in 16-token-block equivalents (bytes of
    one paged block), so observers of either layout read the same units.
    """

    enable_prefix_caching = False
    supports_forks = False

    # No block-hash index: prefix lookups miss, the index reads empty, no KV events.
    indexes_prefixes = False

    def __init__(self, config: CacheConfig, layout: ContiguousLayout, memory: RegionMemory | None):
        """`memory` None: no OS to ask (the simulator); the page arithmetic is the reading."""
        if config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching needs the paged KV layout (the contiguous one shares no pages)")
        self.layout = layout
        self.block_size = config.block_size
        self.memory = memory
        self._bytes_per_block = layout.bytes_per_token * config.block_size
        self._free_regions = list(range(layout.num_regions))  # a heap: lowest first keeps OS readings short
        self._rows: dict[str, _Region] = {}
        # Committed pages = the last reading (less what was released since) + pages handed out since.
        self._base_pages = 0
        self._unsynced_pages = 0
        self._steps_since_sync = 0
        self.peak_committed_pages = 0
        self.num_os_readings = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -------------------------------------------------------------------

    @property
    def committed_pages(self) -> int:
        return self._base_pages + self._unsynced_pages

    @property
    def committed_bytes(self) -> int:
        return self.committed_pages * self.layout.page_size

    @property
    def peak_committed_bytes(self) -> int:
        return self.peak_committed_pages * self.layout.page_size

    @property
    def num_blocks(self) -> int:
        return self.layout.memory_bytes // self._bytes_per_block

    @property
    def num_free_blocks(self) -> int:
        return max(self.layout.memory_bytes - self.committed_bytes, 0) // self._bytes_per_block

    @property
    def usage(self) -> float:
        return self.committed_pages / self.layout.budget_pages

    def waste(self) -> float:
        """Committed bytes holding no stored token, over committed bytes: at most one
        partly filled page per stream per request, plus pages of rejected drafts."""
        committed = sum(self.layout.pages_for(r.num_written_tokens) for r in self._rows.values())
        if committed == 0:
            return 0.0
        stored = sum(r.num_stored_tokens for r in self._rows.values()) * self.layout.bytes_per_token
        return 1 - stored / (committed * self.layout.page_size)

    def fit_error(self, num_tokens: int) -> str | None:
        if num_tokens > self.layout.region_tokens:
            return f"exceeds the KV region of {self.layout.region_tokens} tokens"
        need = self.layout.pages_for(num_tokens) * self.layout.page_size
        if need > self.layout.memory_bytes:
            return f"needs {need} bytes of KV pages; kv_cache_memory is {self.layout.memory_bytes}"
        return None

    def has_blocks(self, request: Request) -> bool:
        return request.request_id in self._rows

    def block_ids(self, request: Request) -> tuple[int, ...]:
        row = self._rows.get(request.request_id)
        if row is None:
            return ()
        first = row.index * self.layout.blocks_per_region
        return tuple(range(first, first + -(-row.num_stored_tokens // self.block_size)))

    def block_tables(self) -> dict[str, tuple[array, int]]:
        return {rid: (array("i", self.block_ids(row.request)), row.num_stored_tokens) for rid, row in self._rows.items()}

    def block_map(self) -> None:
        """Regions, not pooled blocks: nothing to draw block by block."""
        return None

    def cached_hashes(self) -> list[bytes]:
        return []

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        return NO_HIT

    # -- changes -------------------------------------------------------------------

    def begin_step(self) -> None:
        """Called at the start of every schedule(), when every scheduled write has happened."""
        self._steps_since_sync += 1
        if self._steps_since_sync >= SYNC_EVERY_STEPS:
            self.sync()

    def sync(self) -> int:
        """Ask the OS about the pages written since the last reading; returns the committed
        pages (the sum of all readings of the pages still held)."""
        self._steps_since_sync = 0
        layout = self.layout
        rows = [r for r in self._rows.values() if r.num_written_tokens > r.synced_tokens]
        extents = [(r.index, layout.stream_pages(r.synced_tokens), layout.stream_pages(r.num_written_tokens))
                   for r in rows]
        if self.memory is None:
            counts = [layout.num_streams * (end - first) for _, first, end in extents]
        else:
            counts = self.memory.committed_pages(extents)
            self.num_os_readings += 1
        for row, count in zip(rows, counts):
            row.synced_pages += count
            row.synced_tokens = row.num_written_tokens
        self._base_pages += sum(counts)
        self._unsynced_pages = 0
        return self._base_pages

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> Allocation | None:
        """Room for num_new_tokens after the computed ones; None (nothing changed) if the
        pages they would commit exceed the budget or no region is free."""
        row = self._rows.get(request.request_id)
        end = request.num_computed_tokens + num_new_tokens
        written = row.num_written_tokens if row is not None else 0
        growth = self.layout.pages_for(end) - self.layout.pages_for(written) if end > written else 0
        if growth and self.committed_pages + growth > self.layout.budget_pages:
            return None
        if row is None:
            if not self._free_regions:
                return None
            row = _Region(request, heapq.heappop(self._free_regions), 0)
            self._rows[request.request_id] = row
        old_blocks = -(-row.num_stored_tokens // self.block_size)
        row.num_stored_tokens = max(row.num_stored_tokens, end)
        row.num_written_tokens = max(written, end)
        self._unsynced_pages += growth
        self.peak_committed_pages = max(self.peak_committed_pages, self.committed_pages)
        new_blocks = -(-row.num_stored_tokens // self.block_size)
        if new_blocks == old_blocks:
            return NO_CHANGE
        first = row.index * self.layout.blocks_per_region
        return Allocation(tuple(range(first + old_blocks, first + new_blocks)), ())

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """No prefix cache in this layout."""

    def rollback(self, request: Request) -> bool:
        """Forget stored slots past num_computed_tokens (rejected drafts). Their pages stay
        committed (the next tokens overwrite them); True if the table lost a block."""
        row = self._rows[request.request_id]
        keep = request.num_computed_tokens
        if keep >= row.num_stored_tokens:
            return False
        bs = self.block_size
        lost = -(-row.num_stored_tokens // bs) > -(-keep // bs)
        row.num_stored_tokens = keep
        return lost

    def fork(self, parent: Request, child: Request) -> None:
        raise ValueError("n > 1 needs the paged KV layout: a region is never shared")

    def repoint(self, moves: Sequence[tuple[Request, Request]]) -> None:
        raise ValueError("beam search needs the paged KV layout: a region is never shared")

    def free(self, request: Request) -> None:
        """Give the region's pages back to the OS now and return the region to the pool."""
        row = self._rows.pop(request.request_id, None)
        if row is None:
            return
        if self.memory is not None:
            self.memory.release(row.index)
        self._base_pages -= row.synced_pages
        self._unsynced_pages -= self.layout.pages_for(row.num_written_tokens) - self.layout.pages_for(row.synced_tokens)
        heapq.heappush(self._free_regions, row.index)

    # -- the index's observers (there is no index) ------------------------------------

    def record_events(self, on: bool) -> None:
        """Nothing enters an index that does not exist: there is never an event to log."""

    def drain_events(self) -> list[tuple[str, bytes]]:
        return []

    def install_cached_prefix(self, block_hashes: Sequence[bytes]) -> bool:
        raise ValueError("the contiguous KV layout has no prefix cache to install a prefix into")

    # -- checks --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless the OS holds exactly the pages the written tokens
        need (between steps), within the budget, and regions are held once each."""
        self.sync()
        for rid, row in self._rows.items():
            if row.synced_pages != self.layout.pages_for(row.num_written_tokens):
                raise AssertionError(f"request {rid}: the OS holds {row.synced_pages} pages of its region; "
                                     f"its {row.num_written_tokens} written tokens need "
                                     f"{self.layout.pages_for(row.num_written_tokens)}")
        reading = self._base_pages
        if reading > self.layout.budget_pages:
            raise AssertionError(f"{reading} pages committed; the budget is {self.layout.budget_pages}")
        held = [r.index for r in self._rows.values()]
        if len(set(held)) != len(held) or set(held) & set(self._free_regions):
            raise AssertionError("a region is held twice, or held and free")
        if len(held) + len(self._free_regions) != self.layout.num_regions:
            raise AssertionError("regions lost")
        for rid, row in self._rows.items():
            if not row.request.num_computed_tokens <= row.num_stored_tokens <= row.num_written_tokens \
                    <= self.layout.region_tokens:
                raise AssertionError(f"request {rid}: computed {row.request.num_computed_tokens}, stored "
                                     f"{row.num_stored_tokens}, written {row.num_written_tokens}")
