"""Disconnect storms over every kind of request, and overload.

A storm of streaming clients that hang up at random points (before the first token,
mid-prefill of a long prompt, mid-decode) with speculative decoding on, structured
output and n > 1, plus non-streaming clients that time out: within 2 s of the last
drop every KV block is back and nothing runs or waits. A burst of 3x what the server
admits: the excess gets 429 + Retry-After in the error shape, the rest finishes, and
the server's RSS after the burst is within 5% of before. The default run keeps small
storms; PAGEDSERVE_STORM_CLIENTS=500 runs the full-size one.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
from pathlib import Path

import httpx
import pytest

from .server_process import start_server
from .test_server_disconnect import leave_stream, wait_for_empty_engine

STORM_CLIENTS = int(os.environ.get("PAGEDSERVE_STORM_CLIENTS", "60"))
SETTLE_S = 2.0
LONG_PROMPT = "The history of every city is long. " * 100  # ~800 tokens: several 256-token prefill chunks


@pytest.fixture(scope="module")
def spec_server(server_logs):
    proc = start_server(server_logs, "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


def _request(kind: str, i: int) -> tuple[str, dict]:
    base = {"max_tokens": 120, "ignore_eos": True, "temperature": 0.8, "seed": i}
    if kind == "long-prompt":
        return "/v1/completions", {**base, "prompt": LONG_PROMPT + str(i)}
    if kind == "structured":
        return "/v1/completions", {**base, "prompt": f"Digits {i}:", "guided_regex": "[0-9]{100,200}",
                                   "ignore_eos": False}
    if kind == "n>1":
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": f"Story {i}"}], "n": 3}
    return "/v1/completions", {**base, "prompt": f"red green blue red green blue {i} red green"}  # speculates


KINDS = ["long-prompt", "structured", "n>1", "speculative"]


async def _stream_then_leave(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    kind = KINDS[i % len(KINDS)]
    path, body = _request(kind, i)
    # A long prompt leaves before any event: while its prefill is still in 256-token chunks.
    leave_after = 0 if kind == "long-prompt" else rng.randint(0, 5)
    await leave_stream(client, path, body, leave_after, rng, max_wait_s=1.0)
    return kind


async def _time_out(client: httpx.AsyncClient, i: int) -> None:
    path, body = _request(KINDS[i % len(KINDS)], i)
    try:
        await client.post(path, json=body, timeout=random.Random(i).uniform(0.2, 2.0))
    except httpx.TimeoutException:
        pass


def test_disconnect_storm_over_every_kind_of_request(spec_server):
    rng = random.Random(17)

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=STORM_CLIENTS + 20)
        async with httpx.AsyncClient(base_url=spec_server.url, timeout=120, limits=limits) as client:
            streams = [_stream_then_leave(client, i, rng) for i in range(STORM_CLIENTS)]
            timeouts = [_time_out(client, i) for i in range(STORM_CLIENTS // 5)]
            results = await asyncio.gather(*streams, *timeouts)
        return [r for r in results if r]

    kinds = asyncio.run(storm())
    assert set(kinds) == set(KINDS)
    start = time.monotonic()
    with httpx.Client(base_url=spec_server.url, timeout=30) as http:
        gauges = wait_for_empty_engine(http, SETTLE_S)
        elapsed = time.monotonic() - start
        assert gauges == {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0,
                          "num_requests_waiting": 0.0}, gauges
        print(f"storm of {STORM_CLIENTS} streams + {STORM_CLIENTS // 5} timeouts: empty in {elapsed:.2f} s")
        r = http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


MAX_QUEUED, MAX_SEQS = 4, 2


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_three_times_the_admission_limit(server_logs):
    server = start_server(server_logs, "--max-queued-requests", str(MAX_QUEUED), "--max-num-seqs", str(MAX_SEQS))
    burst = 3 * (MAX_QUEUED + MAX_SEQS)
    body = {"prompt": "Count to ten:", "max_tokens": 12, "ignore_eos": True}

    async def one_burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(burst)))

    try:
        asyncio.run(one_burst())  # warm-up: the allocator's first growth is not a leak
        before = rss_bytes(server.proc.pid)
        for _ in range(3):
            results = asyncio.run(one_burst())
        after = rss_bytes(server.proc.pid)
        statuses = sorted(r.status_code for r in results)
        assert set(statuses) == {200, 429}, statuses
        for r in results:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 12
        print(f"3x burst of {burst}: {statuses.count(200)} x 200, {statuses.count(429)} x 429; "
              f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
        assert abs(after - before) <= 0.05 * before
    finally:
        assert server.stop() == 0


def test_a_slow_reader_holds_neither_the_engine_nor_memory(spec_server):
    """A client reading its stream a byte at a time: other requests are served as usual, the
    slow one's request finishes in the engine (its deltas wait in a queue bounded by its
    max_tokens), and the server's RSS does not grow with it."""
    body = json.dumps({"prompt": "A slow story:", "max_tokens": 80, "ignore_eos": True, "stream": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    before = rss_bytes(spec_server.proc.pid)
    with socket.create_connection(("127.0.0.1", spec_server.port), timeout=30) as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        slow.sendall(head + body)
        slow.recv(1)
        with httpx.Client(base_url=spec_server.url, timeout=60) as http:
            start = time.monotonic()
            r = http.post("/v1/completions", json={"prompt": "Quick:", "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200 and time.monotonic() - start < 30
            for _ in range(20):  # one byte every 50 ms while the engine runs the slow request to its end
                slow.recv(1)
                time.sleep(0.05)
            gauges = wait_for_empty_engine(http, 60)
            assert gauges["num_requests_running"] == 0.0  # finished in the engine, not held by the reader
    after = rss_bytes(spec_server.proc.pid)
    assert after - before < 64 << 20, (before, after)
