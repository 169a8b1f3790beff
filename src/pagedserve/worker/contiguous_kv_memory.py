"""The contiguous KV layout's memory: one anonymous mapping that reserves nothing, committed
by the kernel page by page as tokens are written, given back with madvise(DONTNEED).

Python's own `mmap` (MAP_NORESERVE) wrapped by `torch.frombuffer` does it all, so no
native helper is needed: the mapping is made once, torch sees it as an ordinary CPU
tensor (the native ops and SDPA read it in place), and `mmap.madvise` releases a
region. Committed pages are read from /proc/self/pagemap: a page counts when it is
present and mapped by this process alone. `mincore` would also count pages that were
only read, which the kernel maps to its shared zero page without committing anything
(the native op reads whole 8-key tiles, up to 7 keys past a sequence's end).

Layout: [layers, 2 (K, V), regions, region_tokens, kv_heads, head_dim]. Each layer's
slice is a contiguous [2, regions x blocks_per_region, block_size, kv_heads, head_dim]
tensor, the shape the paged kernels take, and region r's blocks are consecutive in it.
Huge pages are turned off for the mapping: a 2 MiB commit per touch would break the
page-granular accounting (and the THP setting 'always' would otherwise apply).
"""
from __future__ import annotations

import mmap
import os
import weakref

import numpy as np
import torch

from ..core.scheduler_config import CacheConfig
from ..core.contiguous_kv import ContiguousKVCacheManager, ContiguousLayout, plan_contiguous
from ..core.kv_tensor_layout import KVTensorLayout
from ..model.config import ModelConfig
from .kv_tensors import kv_cache_torch_dtype

# Linux's value; Python's mmap module does not export it before 3.13.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)

# /proc/self/pagemap: one little-endian u64 per page; bit 63 present, bit 56 mapped
# exclusively (a private page of ours; the zero page never is).
_PRESENT_EXCLUSIVE = np.uint64((1 << 63) | (1 << 56))


def contiguous_layout_for(model: ModelConfig, memory_bytes: int, max_model_len: int, num_regions: int,
                          block_size: int, dtype_bytes: int) -> ContiguousLayout:
    return plan_contiguous(memory_bytes, max_model_len, num_regions, block_size,
                           model.num_kv_heads * model.head_dim * dtype_bytes, 2 * model.num_layers, mmap.PAGESIZE)


def build_contiguous_kv(model: ModelConfig, cache_config: CacheConfig, memory_bytes: int, max_model_len: int,
                        max_num_seqs: int, kv_cache_dtype: str) -> tuple["ContiguousKVStore", ContiguousKVCacheManager]:
    """The mapping (for the runner) and its accounting (for the scheduler): one region per seat."""
    dtype = kv_cache_torch_dtype(kv_cache_dtype)
    layout = contiguous_layout_for(model, memory_bytes, max_model_len, max_num_seqs, cache_config.block_size,
                                   dtype.itemsize)
    store = ContiguousKVStore(layout, model, dtype)
    return store, ContiguousKVCacheManager(cache_config, layout, store)


class ContiguousKVStore:
    """The regions' memory and the per-layer cache tensors over it (a RegionMemory)."""

    def __init__(self, layout: ContiguousLayout, model: ModelConfig, dtype: torch.dtype):
        if layout.page_size != mmap.PAGESIZE:
            raise ValueError(f"layout page_size {layout.page_size} is not the OS page size {mmap.PAGESIZE}")
        self.layout = layout
        self._region_bytes = layout.region_tokens * layout.stream_bytes_per_token  # one stream of one region
        self._stream_bytes = layout.num_regions * self._region_bytes
        size = layout.num_streams * self._stream_bytes
        try:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError as e:
            raise ValueError(f"cannot reserve {size / 2**30:.1f} GiB of address space for the contiguous KV layout "
                             f"({layout.num_regions} regions of {layout.region_tokens} tokens): {e}; lower "
                             "max_num_seqs or max_model_len (vm.overcommit_memory=2 refuses MAP_NORESERVE)") from e
        self._map.madvise(mmap.MADV_NOHUGEPAGE)
        flat = torch.frombuffer(self._map, dtype=torch.uint8).view(dtype)
        self._address = flat.data_ptr()
        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        weakref.finalize(self, os.close, self._pagemap)
        layer = KVTensorLayout(layout.num_regions * layout.blocks_per_region, layout.block_size, model.num_kv_heads,
                               model.head_dim, dtype)
        per_layer = flat.view(model.num_layers, *layer.shape)
        self.kv_caches = list(per_layer.unbind(0))
        self._pages_per_region = self._region_bytes // layout.page_size
        self._entries = np.zeros(0, dtype=np.uint64)

    def _stream_offset(self, stream: int, region: int) -> int:
        return stream * self._stream_bytes + region * self._region_bytes

    def release(self, region: int) -> None:
        for s in range(self.layout.num_streams):
            self._map.madvise(mmap.MADV_DONTNEED, self._stream_offset(s, region), self._region_bytes)

    def committed_pages(self, extents: list[tuple[int, int, int]]) -> list[int]:
        """For each (region, first page, end page): the committed pages among those pages
        of the region's streams, one pagemap read per stream."""
        return [self._count(region, first, end - first) for region, first, end in extents]

    def _count(self, region: int, first: int, pages: int) -> int:
        """Committed pages among pages first .. first + pages - 1 of every stream, counted
        from the start of `region`."""
        if self._entries.size < pages:
            self._entries = np.zeros(pages, dtype=np.uint64)
        entries = self._entries[:pages]
        buffer = [memoryview(entries).cast("B")]
        total = 0
        for s in range(self.layout.num_streams):
            first_page = (self._address + self._stream_offset(s, region)) // self.layout.page_size + first
            if os.preadv(self._pagemap, buffer, first_page * 8) != pages * 8:
                raise OSError("short read of /proc/self/pagemap over the KV regions")
            total += int(np.count_nonzero((entries & _PRESENT_EXCLUSIVE) == _PRESENT_EXCLUSIVE))
        return total

    def resident_bytes(self) -> int:
        """Committed bytes anywhere in the mapping, every region read whole (for tests and
        measurements: it catches a page committed where no token was written)."""
        return self._count(0, 0, self.layout.num_regions * self._pages_per_region) * self.layout.page_size
