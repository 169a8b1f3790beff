"""`/dashboard`: a live page of the engine (KV block map, steps, queues, a chat
playground) and the Server-Sent Events stream that feeds it.

One ticker per app asks the engine thread for a frame a few times a second while
at least one page listens, and none when nobody does; every listener gets the same
encoded frame, with the last minute's latencies and rates added here on the loop.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.staticfiles import StaticFiles

from ...engine.async_engine import AsyncEngine, StepStats
from ...engine.dashboard_feed import DashboardFeed
from ...http.errors import APIError
from ...http.json_body import StrictModel, parse_body
from ...http.openapi import body_responses, event_stream_responses, html_responses, request_body

STATIC_DIR = Path(__file__).parent / "dashboard_static"
# At most this many frames a second: enough to watch blocks come and go, and a
# frame costs the engine thread O(blocks) in C only this often.
FRAMES_PER_SECOND = 4
WINDOW_S = 60.0
# A comment line this often tells a dead connection apart while the engine idles.
KEEPALIVE_S = 10.0
PERCENTILES = (50, 90, 99)


class DashboardHub:
    """The loop side: listeners, the frame ticker, last-minute windows."""

    def __init__(self, engine: AsyncEngine, feed: DashboardFeed, info: dict):
        self._engine = engine
        self.feed = feed
        self._info = info
        self._listeners: set[asyncio.Queue[str]] = set()
        self._latest: str | None = None
        self._ticker: asyncio.Task | None = None
        # (time, value) samples of the last minute, recorded only while watched.
        self._ttft: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self._counters: deque[tuple[float, dict]] = deque()
        self._watch_start = 0.0

    def on_step(self, stats: StepStats) -> None:
        if not self.feed.watched:
            return
        now = time.monotonic()
        self._tokens.append((now, stats.num_generation_tokens))
        self._ttft.extend((now, ttft) for ttft, _ in stats.first_tokens)
        self._itl.extend((now, itl) for itl in stats.inter_token_latencies)

    def on_frame(self, frame: dict) -> None:
        now = time.monotonic()
        frame["info"] = self._info
        frame["window"] = self._window(now, frame["stats"])
        self._latest = f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
        self._broadcast(self._latest)

    def _broadcast(self, message: str) -> None:
        for queue in self._listeners:
            if queue.full():  # a slow page skips to the newest message
                queue.get_nowait()
            queue.put_nowait(message)

    def _window(self, now: float, stats: dict) -> dict:
        cutoff = now - WINDOW_S
        for samples in (self._ttft, self._itl, self._tokens, self._counters):
            while samples and samples[0][0] < cutoff:
                samples.popleft()
        self._counters.append((now, stats))
        first = self._counters[0][1]
        queries = stats["prefix_cache_queries"] - first["prefix_cache_queries"]
        drafted = stats.get("spec_num_draft_tokens", 0) - first.get("spec_num_draft_tokens", 0)
        span = max(now - max(cutoff, self._watch_start), 1e-3)
        return {
            "seconds": round(min(span, WINDOW_S), 1),
            "generation_tokens_per_s": sum(n for _, n in self._tokens) / span,
            "prefix_cache_hit_rate": (stats["prefix_cache_hits"] - first["prefix_cache_hits"]) / queries
            if queries else None,
            "spec_acceptance": (stats["spec_num_accepted_tokens"] - first["spec_num_accepted_tokens"]) / drafted
            if drafted else None,
            "ttft_ms": _percentiles(self._ttft),
            "itl_ms": _percentiles(self._itl),
        }

    async def stream(self) -> AsyncIterator[str]:
        """One page's events: the latest frame at once, then each new one."""
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=1)
        self._listeners.add(queue)
        if not self.feed.watched:
            for samples in (self._ttft, self._itl, self._tokens, self._counters):
                samples.clear()
            self._watch_start = time.monotonic()
            self.feed.watch(True)
            self._ticker = asyncio.create_task(self._tick())
        try:
            if self._latest is not None:
                yield self._latest
            # No wait_for here: on Python 3.11 it can swallow the cancellation that
            # Starlette sends when the page goes, leaving the stream watched forever.
            while True:
                yield await queue.get()
        finally:
            self._listeners.discard(queue)
            if not self._listeners:
                self.feed.watch(False)
                if self._ticker is not None:
                    self._ticker.cancel()
                    self._ticker = None

    async def _tick(self) -> None:
        ticks_per_keepalive = round(KEEPALIVE_S * FRAMES_PER_SECOND)
        for tick in itertools.count(1):
            self._engine.request_frame()
            await asyncio.sleep(1 / FRAMES_PER_SECOND)
            if tick % ticks_per_keepalive == 0:
                self._broadcast(": keepalive\n\n")


def _percentiles(samples: deque[tuple[float, float]]) -> dict[str, float] | None:
    if not samples:
        return None
    values = sorted(v for _, v in samples)
    last = len(values) - 1
    return {f"p{p}": round(values[round(last * p / 100)] * 1000, 2) for p in PERCENTILES}


class SpeculationRequest(StrictModel):
    enabled: bool


class SpeculationResponse(BaseModel):
    enabled: bool


def install_dashboard(app: FastAPI, engine: AsyncEngine, model_name: str, show_prompts: bool) -> list[type[StrictModel]]:
    """Serve /dashboard (the page and its assets) and /dashboard/events (the stream); returns
    the routes' request models for the document. The hub is app.state.dashboard."""
    feed = DashboardFeed(show_prompts)
    llm = engine.engine
    spec = llm.config.serving.speculative_config
    info = {
        "model": model_name,
        "max_model_len": engine.max_context_len,
        # Speculation is a server-wide setting: the page can pause it for everyone.
        "speculative": f"{spec.method}, {spec.num_speculative_tokens} tokens" if spec is not None else None,
        "show_prompts": show_prompts,
    }
    hub = DashboardHub(engine, feed, info)
    engine.attach_feed(feed, hub.on_frame)
    engine.add_step_listener(hub.on_step)
    app.state.dashboard = hub

    @app.get("/dashboard", response_class=FileResponse, responses=html_responses("The live engine page."))
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/dashboard/events", responses=event_stream_responses(
        "The page's frames: the KV block map, steps, queues, one event per engine change."))
    async def dashboard_events() -> StreamingResponse:
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/dashboard/speculation", openapi_extra=request_body(SpeculationRequest),
              responses={**body_responses(SpeculationResponse)})
    async def set_speculation(request: Request) -> JSONResponse:
        """Pause or resume the configured proposer for every request (the playground's switch)."""
        req = parse_body(await request.body(), SpeculationRequest)
        if spec is None:
            raise APIError(404, "speculative decoding is not configured (--speculative-config)")
        engine.call_on_thread(lambda llm: setattr(llm, "speculate", req.enabled))
        return JSONResponse({"enabled": req.enabled})

    # The page's own files (script, styles): not part of the API, so not in the document.
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    return [SpeculationRequest]
