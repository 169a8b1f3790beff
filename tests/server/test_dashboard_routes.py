"""`serve` serves /dashboard by default and not with --no-dashboard; the page's
assets ship inside the package; the event stream watches the engine only while a
page listens."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedserve.engine.dashboard_feed import DashboardFeed
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.args import server_config_from_args
from pagedserve.entrypoints.openai.dashboard import DashboardHub
from pagedserve.entrypoints.openai.server import build_app
from pagedserve.model.loader import load_model


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def config(*flags: str):
    return server_config_from_args(build_parser().parse_args(["serve", "--kv-cache-memory", "16MiB", *flags]))


def get(app, path: str) -> httpx.Response:
    async def fetch() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(fetch())


@pytest.mark.parametrize("flags, served", [((), True), (("--no-dashboard",), False)], ids=["default", "off"])
def test_dashboard_flag(loaded, flags, served):
    cfg = config(*flags)
    assert cfg.dashboard is served and cfg.dashboard_show_prompts is False
    app = build_app(LLMEngine(cfg.engine, loaded=loaded), cfg)
    for path, kind in (("/dashboard", "text/html"), ("/dashboard/static/app.js", "javascript"),
                       ("/dashboard/static/style.css", "text/css")):
        response = get(app, path)
        assert response.status_code == (200 if served else 404), path
        if served:
            assert kind in response.headers["content-type"]
            assert "http://" not in response.text and "https://" not in response.text  # nothing from a CDN


def test_show_prompts_flag():
    assert config("--dashboard-show-prompts").dashboard_show_prompts is True


class _FrameCounter:
    """Stands in for the AsyncEngine: counts the hub's frame requests."""

    def __init__(self):
        self.requests = 0

    def request_frame(self) -> None:
        self.requests += 1


def test_frames_are_asked_for_only_while_a_page_listens():
    async def scenario() -> None:
        engine, feed = _FrameCounter(), DashboardFeed()
        hub = DashboardHub(engine, feed, {"model": "m"})
        received: list[str] = []

        async def page() -> None:
            async for message in hub.stream():
                received.append(message)

        listener = asyncio.create_task(page())
        await asyncio.sleep(0.6)
        assert feed.watched and engine.requests >= 2
        hub.on_frame({"stats": {"prefix_cache_queries": 10, "prefix_cache_hits": 4}})
        await asyncio.sleep(0)
        assert json.loads(received[-1].removeprefix("data: "))["info"] == {"model": "m"}
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        assert not feed.watched
        asked = engine.requests
        await asyncio.sleep(0.6)
        assert engine.requests == asked

    asyncio.run(scenario())
