"""The router's view of each replica: up or down, requests in flight, and the block
hashes its prefix cache holds, learned from the replica's KV events (GET /v1/kv_events).

A replica is down after a failed health check or a connection error, and up again after
its /health answers 200. While its event stream is not connected the router knows
nothing of its cache (the set is cleared: stale keys would send requests to a replica
that restarted empty); a fresh connection starts from the replica's snapshot.

Between routing a request and the replica's `stored` events for it, the router
counts the prompt's blocks as held there for `routed_ttl_s`, so a burst of requests
sharing a new prefix follows the first one instead of spreading before the first
prefill lands.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

logger = logging.getLogger("pagedserve.router")

# Reconnect attempts to a replica's event stream wait this long after a failure.
RECONNECT_S = 0.5


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = False
    in_flight: int = 0
    block_size: int | None = None  # from the replica's snapshot; None until one arrives
    cached: set[bytes] = field(default_factory=set)
    # Blocks of prompts routed here whose stored events have not come yet: hash -> expiry.
    routed: dict[bytes, float] = field(default_factory=dict)
    events_connected: bool = False
    num_requests: int = 0
    num_errors: int = 0
    num_matched_tokens: int = 0

    def holds(self, block_hash: bytes, now: float) -> bool:
        if block_hash in self.cached:
            return True
        expiry = self.routed.get(block_hash)
        return expiry is not None and expiry > now

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        now = time.monotonic()
        n = 0
        for h in hashes:
            if not self.holds(h, now):
                break
            n += 1
        return n

    def note_routed(self, hashes: Sequence[bytes], ttl: float) -> None:
        expiry = time.monotonic() + ttl
        routed = self.routed
        for h in hashes:
            if h not in self.cached:
                routed[h] = expiry
        if len(routed) > 4 * max(len(self.cached), 1024):
            now = time.monotonic()
            self.routed = {h: e for h, e in routed.items() if e > now}

    def apply(self, message: dict) -> None:
        """One decoded event-stream message (entrypoints/openai/kv_events_endpoint.py)."""
        if message.get("type") == "snapshot":
            self.block_size = int(message["block_size"])
            self.cached = {bytes.fromhex(h) for h in message["hashes"]}
            return
        for kind, hex_hash in message["events"]:
            h = bytes.fromhex(hex_hash)
            if kind == "stored":
                self.cached.add(h)
                self.routed.pop(h, None)
            else:
                self.cached.discard(h)
                self.routed.pop(h, None)

    def mark_down(self, why: str) -> None:
        if self.healthy:
            logger.warning("backend %s is down: %s", self.url, why)
        self.healthy = False
        self.forget()

    def forget(self) -> None:
        self.cached = set()
        self.routed = {}


class BackendMonitor:
    """Health checks for every replica and, with `watch_events`, one event stream each."""

    def __init__(self, backends: Sequence[Backend], session: aiohttp.ClientSession, headers: dict[str, str],
                 health_interval_s: float, watch_events: bool):
        self.backends = list(backends)
        self._session = session
        self._headers = headers
        self._interval = health_interval_s
        self._watch_events = watch_events
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))
        self._tasks = [asyncio.create_task(self._health_loop(b)) for b in self.backends]
        if self._watch_events:
            self._tasks += [asyncio.create_task(self._event_loop(b)) for b in self.backends]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def check(self, backend: Backend) -> None:
        try:
            async with self._session.get(backend.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            backend.mark_down(f"{type(e).__name__}: {e}")
            return
        if ok and not backend.healthy:
            logger.info("backend %s is up", backend.url)
        if not ok:
            backend.mark_down(f"/health answered {r.status}")
        backend.healthy = ok

    async def _health_loop(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check(backend)

    async def _event_loop(self, backend: Backend) -> None:
        while True:
            if backend.healthy:
                try:
                    await self._follow(backend)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
                    logger.info("kv events from %s stopped: %s: %s", backend.url, type(e).__name__, e)
                finally:
                    backend.events_connected = False
                    backend.forget()
            await asyncio.sleep(RECONNECT_S)

    async def _follow(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None)
        async with self._session.get(backend.url + "/v1/kv_events", headers=self._headers, timeout=timeout) as r:
            if r.status != 200:
                raise ValueError(f"/v1/kv_events answered {r.status} (an old server, or a wrong --backend-api-key)")
            backend.events_connected = True
            # Lines of one event can exceed aiohttp's default line buffer: read raw.
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n\n")
                for event in complete:
                    if event.startswith(b"data: "):
                        backend.apply(json.loads(event[6:]))
