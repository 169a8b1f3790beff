"""The disk tier's index: which block files a directory holds, their sizes, least recently used first.

A block file is named `<namespace>-<chain hash hex>.kvb`. The namespace names everything
that makes two engines' KV for the same tokens differ (the weights, the KV dtype, the
layout, the block size, the arithmetic: engine/kv_offload_key.py); the chain hash names
the tokens, the tenant's cache salt and the adapter (core/block_hash.py). So an engine
only ever opens files its own arithmetic wrote for the same prefix.

The index is rebuilt at start from names and sizes alone (os.scandir; no payload is read)
and ordered by modification time, which a read refreshes; it counts every `.kvb` file in
the directory, whoever wrote it, so the size bound holds for the directory. Engines that
share the directory learn of each other's files when a lookup misses here and a stat finds
the file. Pure Python: the reads and writes are the worker half's
(kv_transfer/disk_tier_worker.py). A small in-process lock guards the dict (the scheduler
looks up while the worker's threads add and evict); no lock is taken across processes.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
# A temp file older than this is a killed writer's; a younger one may be another engine's
# write in progress, which takes milliseconds.
STALE_TEMP_SECONDS = 60.0


@dataclass(frozen=True)
class KVOffloadConfig:
    """`--kv-offload-dir` and `--kv-offload-size` (bytes), checked."""

    directory: str
    size: int
    # The scheduler's failure policy for a load (transfer_hooks.py): a failed tier read is a
    # miss, recomputed. A class constant, not a field: it is not an option.
    kv_load_failure_policy: ClassVar[str] = "recompute"

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ValueError(f"kv_offload_dir must be a directory path, got {self.directory!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"kv_offload_size must be a size like 20GiB, got {self.size!r}")


def block_file_name(namespace: str, block_hash: bytes) -> str:
    return f"{namespace}-{block_hash.hex()}{SUFFIX}"


class DiskIndex:
    """File name -> size, least recently used first, bounded by `capacity` bytes."""

    def __init__(self, directory: str, capacity: int):
        self.directory = directory
        self.capacity = capacity
        self._files: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def rebuild(self) -> list[str]:
        """Read the directory's names and sizes (creating it if absent); delete stale temp
        files a killed writer left. Returns the names to evict beyond capacity."""
        os.makedirs(self.directory, exist_ok=True)
        found = []
        stale = time.time() - STALE_TEMP_SECONDS
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX):
                    if entry.stat(follow_symlinks=False).st_mtime < stale:
                        _unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        with self._lock:
            self._files = OrderedDict((name, size) for _, name, size in found)
            self._bytes = sum(size for _, _, size in found)
            return self._over_capacity()

    def contains(self, name: str, look_on_disk: bool = True) -> bool:
        """In the index, or (look_on_disk) a file another engine wrote since: then indexed."""
        if name in self._files:
            return True
        if not look_on_disk:
            return False
        try:
            size = os.stat(self.path(name)).st_size
        except OSError:
            return False
        with self._lock:  # no eviction here: the writer's next add evicts (and deletes) for it
            if name not in self._files:
                self._files[name] = size
                self._bytes += size
        return True

    def touch(self, name: str) -> None:
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)

    def add(self, name: str, size: int) -> list[str]:
        """Index a published file; returns the names to evict to stay within capacity."""
        with self._lock:
            old = self._files.pop(name, None)
            self._bytes += size - (old or 0)
            self._files[name] = size
            return self._over_capacity()

    def remove(self, name: str) -> bool:
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self._bytes -= size
            return size is not None

    def shrink(self, capacity: int) -> list[str]:
        """Lower the bound (the disk filled before it); returns the names to evict."""
        with self._lock:
            self.capacity = capacity
            return self._over_capacity()

    def clear(self) -> None:
        with self._lock:
            self._files.clear()
            self._bytes = 0

    def _over_capacity(self) -> list[str]:
        """Called with the lock held: drop least recently used entries beyond capacity."""
        evicted = []
        while self._bytes > self.capacity and self._files:
            name, size = self._files.popitem(last=False)
            self._bytes -= size
            evicted.append(name)
        return evicted


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
