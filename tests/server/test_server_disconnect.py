"""A client that goes away aborts its request and frees its KV blocks at once."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

SETTLE_S = 2.0


def engine_gauges(http: httpx.Client) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name in ("pagedserve:kv_cache_usage_perc", "pagedserve:num_requests_running",
                          "pagedserve:num_requests_waiting"):
                out[s.name.split(":")[1]] = s.value
    return out


def wait_for_empty_engine(http: httpx.Client, within_s: float) -> dict[str, float]:
    """Poll until no KV block is held and nothing runs or waits; the last gauges seen."""
    deadline = time.monotonic() + within_s
    while True:
        gauges = engine_gauges(http)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.05)


async def leave_stream(client: httpx.AsyncClient, path: str, body: dict, leave_after: int, rng: random.Random,
                       max_wait_s: float = 0.5) -> int:
    """Stream `body` and hang up after `leave_after` events, or (0) before any response,
    cancelling after a random wait of up to `max_wait_s`; the events seen."""
    body = {**body, "stream": True}
    if leave_after == 0:
        task = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(rng.uniform(0.0, max_wait_s))
        task.cancel()
        return 0
    seen = 0
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= leave_after:
                    break
    return seen


async def _stream_then_leave(url: str, i: int, rng: random.Random) -> int:
    """Stream a long completion and hang up after a random number of events (0 = before the first)."""
    body = {"prompt": f"Client {i} tells a long story:", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0.8, "seed": i}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await leave_stream(client, "/v1/completions", body, rng.randint(0, 6), rng)


def test_fifty_streaming_clients_leaving_at_random_points_free_everything(server, http):
    rng = random.Random(0)

    async def storm():
        return await asyncio.gather(*(_stream_then_leave(server.url, i, rng) for i in range(50)))

    seen = asyncio.run(storm())
    assert any(s == 0 for s in seen) and any(s > 3 for s in seen)
    start = time.monotonic()
    gauges = wait_for_empty_engine(http, SETTLE_S)
    elapsed = time.monotonic() - start
    assert gauges == {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}, gauges
    print(f"disconnect storm: engine empty {elapsed:.2f} s after the last client left")
    aborted = [s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples
               if s.name == "pagedserve:request_success_total" and s.labels["finished_reason"] == "abort"]
    # Every client that got a stream left long before its 200 tokens (early leavers may never have started).
    assert aborted and aborted[0] >= sum(1 for s in seen if s > 0)
    r = http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_non_streaming_client_leaving_aborts_its_request(server, http):
    body = {"prompt": "A very long answer:", "max_tokens": 900, "ignore_eos": True}
    with httpx.Client(base_url=server.url) as client:
        try:
            client.post("/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass  # the client hung up while the server was generating
    gauges = wait_for_empty_engine(http, SETTLE_S)
    assert gauges == {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}, gauges
