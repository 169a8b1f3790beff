"""The disk tier's worker half: a writer thread with a bounded queue and a pool of readers.

Saves (a finished request's blocks the tier lacks): the engine's thread only queues them;
when they would take the queue past WRITE_QUEUE_BLOCKS blocks the save is dropped and
counted, and its blocks go back at once.
The writer copies the blocks out of the KV tensors, reports them free, then writes one
file per block (kv_transfer/disk_block_file.py) and indexes it, evicting the least
recently used files beyond the size.

Loads: a reader thread reads and checks each file and copies it into the blocks the
scheduler half allocated, then reports the load; any file that is missing, torn or corrupt
fails the whole load (the request recomputes those tokens) and a damaged file is deleted.

Faults never stop the engine: a full disk (ENOSPC, a quota, a file-size limit) shrinks the
tier to what it holds, and disables writing once that is under one block; a directory
deleted under the engine is made again once; any other write error (a read-only
directory) disables writing. Each is logged once and counted (kv_disk_write_errors,
kv_disk_writes_disabled); reads keep serving what is there.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..core.kv_connector import KVConnectorOutput
from ..core.kv_disk_index import DiskIndex
from ..core.kv_disk_tier import DiskBlocks, DiskTierMetadata
from ..core.kv_tensor_layout import KVTensorLayout
from .base import KVConnectorWorker
from .disk_block_file import BlockFileShape, CorruptBlockFile, read_block_file, write_block_file
from .frame import DTYPES

logger = logging.getLogger(__name__)

# Blocks that may wait for the writer at once (or one request's, if more): the most a slow
# disk holds out of the pool.
WRITE_QUEUE_BLOCKS = 256
_READ_THREADS = 2
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# A full disk keeps this share of what the tier holds, so the next writes find room.
_SHRINK = 0.9


class DiskTierWorker(KVConnectorWorker):
    def __init__(self, index: DiskIndex, namespace: str, queue_blocks: int = WRITE_QUEUE_BLOCKS):
        self.index = index
        self.namespace = namespace
        self.engine_id, self.host, self.port = namespace, "", 0
        self._kv_caches: list[torch.Tensor] = []
        self._shape: BlockFileShape | None = None
        self._lock = threading.Lock()
        self._finished = KVConnectorOutput()
        self._activity = threading.Event()
        self._loads: list[DiskBlocks] = []
        self._queue: queue.Queue[DiskBlocks | None] = queue.Queue()
        self._queue_blocks = queue_blocks
        self._queued_blocks = 0  # in the queue, not yet copied out of the KV tensors
        self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="kv-disk-read")
        self._writing = True
        self._remade_directory = False
        self.counters = {name: 0 for name in (
            "kv_disk_blocks_read", "kv_disk_blocks_written", "kv_disk_bytes_read", "kv_disk_bytes_written",
            "kv_disk_read_microseconds", "kv_disk_loads_failed", "kv_disk_corrupt_files", "kv_disk_evictions",
            "kv_disk_writes_dropped", "kv_disk_write_errors", "kv_disk_writes_disabled")}
        try:
            self._evict(index.rebuild())
        except OSError as e:
            raise ValueError(f"kv_offload_dir {index.directory!r} cannot be read or made: {e}") from None
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-write", daemon=True)
        self._writer.start()
        logger.info("KV disk tier: %s, %d files, %.2f of %.2f GiB", index.directory, len(index),
                    index.num_bytes / 2**30, index.capacity / 2**30)

    # -- the engine's side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches)
        layouts = {KVTensorLayout.of(kv).blocks_shape(1) + (kv.dtype,) for kv in kv_caches}
        if len(layouts) != 1:
            raise ValueError(f"kv_offload_dir needs every layer's KV cache alike, got {sorted(map(str, layouts))}")
        kv = kv_caches[0]
        dtype = str(kv.dtype).removeprefix("torch.")
        self._shape = BlockFileShape(bytes.fromhex(self.namespace), DTYPES[dtype][0], len(kv_caches),
                                     KVTensorLayout.of(kv).block_bytes)

    def bind_connector_metadata(self, metadata: DiskTierMetadata | None) -> None:
        if metadata is None:
            return
        self._loads += metadata.loads
        for save in metadata.saves:
            with self._lock:
                # An empty queue takes any request, so a prompt longer than the bound is written too.
                room = not self._queued_blocks or self._queued_blocks + len(save.block_ids) <= self._queue_blocks
                if room:
                    self._queued_blocks += len(save.block_ids)
                else:
                    self.counters["kv_disk_writes_dropped"] += len(save.names)
            if room:
                self._queue.put(save)
            else:
                self._report("finished_sending", save.request_id)

    def start_load_kv(self) -> None:
        loads, self._loads = self._loads, []
        for load in loads:
            self._readers.submit(self._load, load)

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out, self._finished = self._finished, KVConnectorOutput()
        return out

    def wait_for_activity(self, timeout: float) -> None:
        if self._activity.wait(timeout):
            self._activity.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "kv_disk_capacity_bytes": self.index.capacity}

    def shutdown(self) -> None:
        """Stop reading; the writer finishes what is queued (its files are whole or absent either way)
        and stops."""
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._queue.put(None)

    def _report(self, kind: str, request_id: str) -> None:
        with self._lock:
            getattr(self._finished, kind).add(request_id)
        self._activity.set()

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    # -- loads ------------------------------------------------------------------------

    def _load(self, load: DiskBlocks) -> None:
        ok = False
        try:
            self._read_into(load)
            ok = True
        except (OSError, CorruptBlockFile) as e:
            logger.info("KV disk tier: a load for request %s missed: %s", load.request_id, e)
        except Exception:  # any failure must be reported, or the request would wait forever
            logger.exception("KV disk tier: a load for request %s failed", load.request_id)
        if not ok:
            self._count("kv_disk_loads_failed")
        self._report("finished_recving" if ok else "failed_recving", load.request_id)

    def _read_into(self, load: DiskBlocks) -> None:
        shape = self._shape
        started = time.perf_counter()
        for name, block_id in zip(load.names, load.block_ids):
            path = self.index.path(name)
            try:
                payload = read_block_file(path, shape, bytes.fromhex(name[len(self.namespace) + 1:-4]))
            except CorruptBlockFile:
                self.index.remove(name)
                self._count("kv_disk_corrupt_files")
                _unlink(path)
                raise
            except OSError:
                self.index.remove(name)
                if not os.path.isdir(self.index.directory):  # deleted under the engine: every file is gone
                    self.index.clear()
                raise
            src = torch.frombuffer(payload, dtype=torch.uint8).view(shape.num_layers, shape.layer_bytes)
            with torch.inference_mode():
                for layer, kv in enumerate(self._kv_caches):
                    raw = kv.view(torch.uint8)[:, block_id]
                    raw.copy_(src[layer].view(raw.shape))
            self.index.touch(name)
            try:
                os.utime(path)  # the recency a restart or another engine orders eviction by
            except OSError:
                pass
        with self._lock:
            self.counters["kv_disk_blocks_read"] += len(load.names)
            self.counters["kv_disk_bytes_read"] += len(load.names) * shape.file_bytes
            self.counters["kv_disk_read_microseconds"] += int((time.perf_counter() - started) * 1e6)

    # -- writes -----------------------------------------------------------------------

    def drain(self) -> None:
        """Wait until every queued save is on disk or dropped (tests; a clean stop)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while (save := self._queue.get()) is not None:
            try:
                self._save(save)
            except Exception:  # the writer must outlive any one save
                logger.exception("KV disk tier: saving request %s failed", save.request_id)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _save(self, save: DiskBlocks) -> None:
        try:
            payloads = self._gather(save) if self._writing else []
        finally:
            with self._lock:
                self._queued_blocks -= len(save.block_ids)
            self._report("finished_sending", save.request_id)
        if not self._writing:
            self._count("kv_disk_writes_dropped", len(save.names))
        for name, payload in payloads:
            if self._writing:
                self._write(name, payload)
            else:
                self._count("kv_disk_writes_dropped")

    def _gather(self, save: DiskBlocks) -> list[tuple[str, bytes]]:
        """Copy the blocks out of the KV tensors (then the scheduler may free them)."""
        out = []
        with torch.inference_mode():
            for name, block_id in zip(save.names, save.block_ids):
                if self.index.contains(name, look_on_disk=False):
                    continue
                block = torch.stack([kv.view(torch.uint8)[:, block_id] for kv in self._kv_caches]).cpu()
                out.append((name, block.numpy().tobytes()))
        return out

    def _write(self, name: str, payload: bytes) -> None:
        shape = self._shape
        path = self.index.path(name)
        block_hash = bytes.fromhex(name[len(self.namespace) + 1:-4])
        try:
            write_block_file(path, shape, block_hash, payload)
        except OSError as e:
            if not self._write_failed(e):
                return
            try:
                write_block_file(path, shape, block_hash, payload)
            except OSError as again:
                self._write_failed(again)
                return
        with self._lock:
            self.counters["kv_disk_blocks_written"] += 1
            self.counters["kv_disk_bytes_written"] += shape.file_bytes
        self._evict(self.index.add(name, shape.file_bytes))

    def _write_failed(self, e: OSError) -> bool:
        """Count and log a failed write and adapt the tier; True to retry it once."""
        self._count("kv_disk_write_errors")
        if e.errno == errno.ENOENT and os.path.isdir(self.index.directory):
            return False  # another engine's start took our temp file for a killed writer's
        if e.errno == errno.ENOENT and not self._remade_directory:
            self._remade_directory = True
            logger.warning("KV disk tier: %s vanished (%s); making it again, its files are gone",
                           self.index.directory, e)
            self.index.clear()
            try:
                os.makedirs(self.index.directory, exist_ok=True)
                return True
            except OSError as again:
                e = again
        if e.errno in _DISK_FULL:
            capacity = int(self.index.num_bytes * _SHRINK)
            if capacity >= self._shape.file_bytes:
                logger.warning("KV disk tier: the disk is full (%s); the tier shrinks to %.1f MiB",
                               e, capacity / 2**20)
                self._evict(self.index.shrink(capacity))
                return False
        logger.warning("KV disk tier: writing to %s failed (%s); the tier stops writing and keeps serving reads",
                       self.index.directory, e)
        self._writing = False
        self._count("kv_disk_writes_disabled")
        return False

    def _evict(self, names: list[str]) -> None:
        for name in names:
            _unlink(self.index.path(name))
        if names:
            self._count("kv_disk_evictions", len(names))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
