"""Past --max-queued-requests the server answers 429 at once; what it accepted still completes."""
from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import pytest

from .server_process import start_server

MAX_QUEUED = 2


@pytest.fixture(scope="module")
def small_queue_server(server_logs):
    proc = start_server(server_logs, "--max-queued-requests", str(MAX_QUEUED), "--max-num-seqs", "2")
    yield proc
    proc.stop()


def test_overload_gets_429_while_accepted_requests_complete(small_queue_server):
    body = {"prompt": "Count to ten:", "max_tokens": 12, "ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        start = time.monotonic()
        r = await client.post("/v1/completions", json=body)
        return r, time.monotonic() - start

    async def burst():
        async with httpx.AsyncClient(base_url=small_queue_server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(16)))

    results = asyncio.run(burst())
    rejected = [(r, t) for r, t in results if r.status_code == 429]
    accepted = [r for r, _ in results if r.status_code != 429]
    assert rejected and len(accepted) >= MAX_QUEUED
    for r, elapsed in rejected:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    slowest_accepted = max(t for r, t in results if r.status_code == 200)
    assert min(t for _, t in rejected) < slowest_accepted  # refused at once, not after queueing
    for r in accepted:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 12


def test_engine_rejection_is_a_400_and_queues_nothing(small_queue_server):
    """n above --max-num-seqs passes the server's own checks; the engine refuses it on arrival."""
    with httpx.Client(base_url=small_queue_server.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and "max_num_seqs" in r.json()["error"]["message"]
        metrics = client.get("/metrics").text
        assert 'pagedserve:num_requests_waiting{model_name="SmolLM2-135M-Instruct"} 0.0' in metrics
        assert 'pagedserve:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.0' in metrics
        ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "n": 2, "ignore_eos": True})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_overload_on_the_messages_route_is_anthropics_rate_limit_error(small_queue_server):
    claude = anthropic.AsyncAnthropic(base_url=small_queue_server.url, api_key="unused", max_retries=0, timeout=120)
    hi = {"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "messages": [{"role": "user", "content": "Count."}]}

    async def burst():
        return await asyncio.gather(*(claude.messages.create(**hi) for _ in range(16)), return_exceptions=True)

    results = asyncio.run(burst())
    rejected = [r for r in results if isinstance(r, anthropic.RateLimitError)]
    accepted = [r for r in results if not isinstance(r, anthropic.RateLimitError)]
    assert rejected and len(accepted) >= MAX_QUEUED
    for error in rejected:
        assert error.body["error"]["type"] == "rate_limit_error" and error.response.headers["retry-after"] == "1"
    assert all(m.type == "message" and m.usage.output_tokens >= 1 for m in accepted), accepted
