"""The engine-thread side of the KV event stream: the prefix-cache index's changes, per step.

The server turns it on when the first subscriber arrives and off when the last one
leaves; while off, the engine thread reads one flag per iteration and the KV cache records
nothing. Every method here runs on the engine thread (AsyncEngine.call_on_thread and its
step loop); batches cross to the event loop through `post`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every hash the index holds at one point of the event sequence."""

    block_size: int
    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The index changes of one engine iteration, in order: (kind, hash)."""

    events: list[tuple[str, bytes]]


class KVEventFeed:
    def __init__(self, post: Callable[[KVSnapshot | KVEventBatch], None]):
        # `post` is called on the engine thread and must hand the item to the event loop.
        self._post = post
        self.active = False

    @staticmethod
    def unsupported_reason(engine: LLMEngine) -> str | None:
        """Why this engine has no index to stream (None when it has one)."""
        if not engine.scheduler.kv_cache.indexes_prefixes:
            return ("KV events stream the paged layout's prefix-cache index; this server runs "
                    "--kv-layout contiguous, which keeps none")
        return None

    def sync(self, engine: LLMEngine) -> None:
        """Start recording if needed and post a snapshot; events pending before it are
        posted first, so a subscriber that takes the snapshot and what follows is exact."""
        kv = engine.scheduler.kv_cache
        kv.record_events(True)
        self.after_step(engine)
        self.active = True
        self._post(KVSnapshot(engine.config.kv.block_size, kv.cached_hashes()))

    def stop(self, engine: LLMEngine) -> None:
        engine.scheduler.kv_cache.record_events(False)
        self.active = False

    def after_step(self, engine: LLMEngine) -> None:
        events = engine.scheduler.kv_cache.drain_events()
        if events:
            self._post(KVEventBatch(events))
