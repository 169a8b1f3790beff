"""GET /v1/kv_events: the prefix-cache index as Server-Sent Events, for prefix-aware routers.

Each subscriber first gets a snapshot of every block hash the engine's index holds,
then, per engine iteration that changed it, the changes in order:

    data: {"type": "snapshot", "block_size": 16, "hashes": ["<64 hex>", ...]}
    data: {"type": "events", "events": [["stored", "<64 hex>"], ["removed", "<64 hex>"], ...]}

Hashes are the engine's chained block hashes (core/block_hash.py), so a router that
tokenises a prompt the same way computes the same keys. Recording starts with the first
subscriber and stops with the last (core/kv_events.py). A subscriber that falls
behind is not dropped silently: its backlog is discarded and it gets a fresh snapshot.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.responses import StreamingResponse

from ...engine.async_engine import AsyncEngine, EngineDeadError
from ...engine.kv_event_feed import KVEventBatch, KVEventFeed, KVSnapshot
from ...http.errors import APIError
from ...http.openapi import event_stream_responses

# Messages a subscriber may have waiting before it is resynchronised with a snapshot.
MAX_BACKLOG = 1024
# A comment line this often tells a dead connection apart while the cache is quiet.
KEEPALIVE_S = 10.0


def encode(item: KVSnapshot | KVEventBatch) -> str:
    if isinstance(item, KVSnapshot):
        payload = {"type": "snapshot", "block_size": item.block_size, "hashes": [h.hex() for h in item.hashes]}
    else:
        payload = {"type": "events", "events": [[kind, h.hex()] for kind, h in item.events]}
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Subscriber:
    __slots__ = ("queue", "synced")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue(MAX_BACKLOG)
        self.synced = False


class KVEventHub:
    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        self._subscribers: list[_Subscriber] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.feed = KVEventFeed(self._post)
        engine.attach_kv_events(self.feed)

    def _post(self, item: KVSnapshot | KVEventBatch) -> None:  # on the engine thread
        self._loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: KVSnapshot | KVEventBatch) -> None:
        is_snapshot = isinstance(item, KVSnapshot)
        targets = [s for s in self._subscribers if s.synced != is_snapshot]
        if not targets:
            return
        message = encode(item)
        for sub in targets:
            if sub.queue.full():
                while not sub.queue.empty():
                    sub.queue.get_nowait()
                sub.synced = False
                self._sync()
                continue
            sub.queue.put_nowait(message)
            sub.synced = True

    def _sync(self) -> None:
        self._engine.call_on_thread(self.feed.sync)

    def subscribe(self) -> _Subscriber:
        """A new subscriber, its snapshot on the way; EngineDeadError if the engine is gone."""
        self._loop = asyncio.get_running_loop()
        self._sync()
        sub = _Subscriber()
        self._subscribers.append(sub)
        return sub

    async def stream(self, sub: _Subscriber) -> AsyncIterator[str]:
        getter: asyncio.Future | None = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(sub.queue.get())
                # asyncio.wait, not wait_for: it never swallows the cancellation Starlette
                # sends when the client goes. A pending get is kept across keepalives.
                done, _ = await asyncio.wait((getter,), timeout=KEEPALIVE_S)
                if done:
                    message, getter = getter.result(), None
                    yield message
                else:
                    yield ": keepalive\n\n"
        finally:
            if getter is not None:
                getter.cancel()
            self._subscribers.remove(sub)
            if not self._subscribers:
                try:
                    self._engine.call_on_thread(self.feed.stop)
                except EngineDeadError:
                    pass  # shutting down: the pool goes with the engine


def install_kv_events(app: FastAPI, engine: AsyncEngine) -> KVEventHub:
    hub = KVEventHub(engine)
    unsupported = KVEventFeed.unsupported_reason(engine.engine)

    @app.get("/v1/kv_events", responses=event_stream_responses(
        "The prefix-cache index: a snapshot event, then the index's changes per engine step.",
        {400: "This engine shape keeps no index (--kv-layout contiguous)."}))
    async def kv_events() -> StreamingResponse:
        if unsupported is not None:
            raise APIError(400, unsupported)
        return StreamingResponse(hub.stream(hub.subscribe()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return hub
