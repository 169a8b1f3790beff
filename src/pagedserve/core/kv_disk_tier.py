"""The disk tier's scheduler half: a second prefix cache under the block pool, as a KV connector.

Lookups: after the RAM prefix hit, the next leading full blocks whose files the tier's
index holds are loaded into freshly allocated blocks; the request waits for them
(WAITING_FOR_REMOTE_KVS, like a P/D consumer), so no step waits on the disk. A load that
fails (a torn, corrupt or vanished file) is recomputed.

Writes: write-through when a request ends. Its full, computed blocks that the tier lacks
are held (not freed) until the worker half's writer thread has copied them out or dropped
them (its queue full, the disk failing); then they go back to the pool as usual. Writing
on eviction instead would copy out of a block the same step's forward is about to
overwrite, which would put the copy on the step path; and a tier written only on eviction
loses everything still in RAM when the process is killed.

Requests with a LoRA adapter skip the tier: an adapter's id in the chain hash is a slot
number that names another adapter after a restart.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .block_hash import extend_block_hashes
from .kv_connector import KVConnectorMetadata, KVConnectorScheduler
from .kv_disk_index import DiskIndex, KVOffloadConfig, block_file_name
from .request import Request


@dataclass(frozen=True, slots=True)
class DiskBlocks:
    """Files and the local blocks they are read into (a load) or written from (a save)."""

    request_id: str
    names: tuple[str, ...]
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class DiskTierMetadata(KVConnectorMetadata):
    loads: list[DiskBlocks] = field(default_factory=list)
    saves: list[DiskBlocks] = field(default_factory=list)


class DiskTierScheduler(KVConnectorScheduler):
    def __init__(self, config: KVOffloadConfig, index: DiskIndex, namespace: str, block_size: int):
        self.config = config
        self.index = index
        self.namespace = namespace
        self.block_size = block_size
        # Requests whose blocks wait for the writer, by id: how many blocks.
        self._held: dict[str, int] = {}
        self._loads: dict[str, tuple[str, ...]] = {}
        self._meta = DiskTierMetadata()
        self._num_loading = 0
        self.counters = {"kv_disk_lookups": 0, "kv_disk_hit_blocks": 0}

    def validate_request(self, request: Request) -> None:
        if request.kv_transfer_params is not None:
            raise ValueError("kv_transfer_params needs a KV connector (--kv-transfer-config); "
                             "this engine runs the disk tier (--kv-offload-dir)")

    def _names(self, request: Request, first: int, end: int) -> list[str]:
        hashes = request.block_hashes
        if len(hashes) < end:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, end, request.cache_salt,
                                request.lora_id)
        return [block_file_name(self.namespace, h) for h in hashes[first:end]]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        first = num_computed_tokens // bs
        # At least one token is computed: its logits give the next token.
        end = (request.num_tokens - 1) // bs
        if request.lora_id or request.skip_prefix_cache or first >= end:
            return 0, False
        self.counters["kv_disk_lookups"] += 1
        found = []
        for name in self._names(request, first, end):
            if not self.index.contains(name):
                break
            found.append(name)
        if not found:
            return 0, False
        self._loads[request.request_id] = tuple(found)
        return len(found) * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        names = self._loads.pop(request.request_id)
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        self._meta.loads.append(DiskBlocks(request.request_id, names[:count], tuple(block_ids[first:first + count])))
        self._num_loading += 1
        self.counters["kv_disk_hit_blocks"] += count

    def load_finished(self, request_id: str) -> None:
        self._num_loading -= 1

    def build_connector_meta(self) -> DiskTierMetadata | None:
        meta = self._meta
        if not (meta.loads or meta.saves):
            return None
        self._meta = DiskTierMetadata()
        return meta

    def has_pending_work(self) -> bool:
        return bool(self._held or self._num_loading)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the request's computed full blocks the tier lacks for the writer."""
        self._loads.pop(request.request_id, None)
        # Verified KV of tokens the request still holds (a stop inside accepted drafts cuts tokens
        # whose KV was computed).
        num_full = min(min(request.num_verified_tokens, request.num_tokens - 1) // self.block_size, len(block_ids))
        if request.lora_id or request.skip_prefix_cache or num_full == 0:
            return False, None
        contains = self.index.contains
        todo = [(name, block_id) for name, block_id in zip(self._names(request, 0, num_full), block_ids)
                if not contains(name, look_on_disk=False)]
        if not todo:
            return False, None
        names, ids = zip(*todo)
        self._held[request.request_id] = len(ids)
        self._meta.saves.append(DiskBlocks(request.request_id, names, ids))
        return True, None

    def on_finished_sending(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {**self.counters, "kv_disk_held_blocks": sum(self._held.values()),
                "kv_disk_loading_requests": self._num_loading, "kv_disk_files": len(self.index),
                "kv_disk_bytes": self.index.num_bytes}
