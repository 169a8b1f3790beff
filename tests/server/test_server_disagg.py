"""Disaggregated prefill/decode with real processes: a prefill instance (kv_producer), a
decode instance (kv_consumer), a colocated reference and `pagedserve router --prefill
--decode`, every instance on one thread (a second decode instance joins to be killed).

Greedy outputs through the router equal the colocated instance's; a consumer that has a
prefix cached pulls only the blocks after it; blocks nobody pulls come back when the
lease runs out; after a storm with clients leaving mid-prefill and mid-decode, and after
a decode instance and then the prefill instance are killed, every block is back on every
surviving instance (and a load from the dead producer is recomputed, same output). The
tests run in file order: the last two kill instances. PAGEDSERVE_PD_STORM=200 runs the
full-size storm (default 40).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server_process import ServerProcess, start_router, start_server

STORM_CLIENTS = int(os.environ.get("PAGEDSERVE_PD_STORM", "40"))
LEASE_S = 3.0
ONE_THREAD = ("--num-threads", "1")
# Several servers loading at once on a busy 2-core machine take minutes, not seconds.
STARTUP_S = 600.0
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
TEXTS = ["Hi", "The capital of France is",
         "A long story about a lighthouse keeper who counted the waves every night, " * 4]


def _config(role: str) -> str:
    return json.dumps({"kv_connector": "PagedServeConnector", "kv_role": role, "lease_seconds": LEASE_S})


@pytest.fixture(scope="module")
def pd(server_logs):
    flags = {"prefill": ("--kv-transfer-config", _config("kv_producer")),
             "decode1": ("--kv-transfer-config", _config("kv_consumer")),
             "colocated": ()}
    procs: dict[str, ServerProcess] = {}
    try:
        with ThreadPoolExecutor(len(flags)) as pool:
            futures = {name: pool.submit(start_server, server_logs, *ONE_THREAD, *f, startup_timeout_s=STARTUP_S) for name, f in flags.items()}
            for name, future in futures.items():
                procs[name] = future.result()
        procs["router"] = start_router(server_logs, "--prefill", procs["prefill"].url, "--decode", procs["decode1"].url)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()
    for name in ("decode1", "router"):
        assert "Traceback" not in procs[name].log(), procs[name].log()[-3000:]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name.removeprefix("pagedserve:").removesuffix("_total")] = s.value
    return out


def settled(url: str, within_s: float) -> dict[str, float]:
    """Poll until no block is used or held and nothing runs, waits or loads; the last metrics."""
    keys = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "kv_transfer_held_requests",
            "kv_transfer_loading_requests")
    deadline = time.monotonic() + within_s
    while True:
        m = metrics(url)
        if not any(m.get(k, 0) for k in keys) or time.monotonic() > deadline:
            return {k: m.get(k, 0) for k in (*keys, "kv_transfer_blocks_received", "kv_transfer_loads_failed",
                                             "kv_transfer_leases_expired", "kv_transfer_blocks_sent")}
        time.sleep(0.1)


def assert_settled(*urls: str, within_s: float = LEASE_S + 3) -> None:
    for url in urls:
        m = settled(url, within_s)
        assert not any(m[k] for k in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
                                      "kv_transfer_held_requests", "kv_transfer_loading_requests")), (url, m)


def complete(url: str, body: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_text(url: str, body: dict, path: str = "/v1/completions") -> str:
    parts = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice:
                    parts.append(choice[0].get("text") or choice[0].get("delta", {}).get("content") or "")
    return "".join(parts)


def by_hand(prefill: str, decode: str, body: dict) -> dict:
    """The router's two phases, against chosen instances."""
    held = complete(prefill, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = held["kv_transfer_params"]
    assert params["num_tokens"] == held["usage"]["prompt_tokens"]
    return complete(decode, {**body, "kv_transfer_params": params})


def received(url: str) -> float:
    return metrics(url)["kv_transfer_blocks_received"]


def test_greedy_through_the_router_equals_one_colocated_instance(pd):
    router, ref = pd["router"].url, pd["colocated"].url
    before = received(pd["decode1"].url)
    for prompt in (*TEXTS, list(range(500, 560))):
        body = {"prompt": prompt, **GREEDY}
        want = complete(ref, body)["choices"][0]["text"]
        got = complete(router, body)
        assert got["choices"][0]["text"] == want
        assert "kv_transfer_params" not in got  # the client sees an ordinary response
        assert streamed_text(router, body) == want
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], **GREEDY}
    want = complete(ref, chat, "/v1/chat/completions")["choices"][0]["message"]["content"]
    assert complete(router, chat, "/v1/chat/completions")["choices"][0]["message"]["content"] == want
    assert streamed_text(router, chat, "/v1/chat/completions") == want
    # The decodes loaded their prompts' KV rather than prefilling (a fallback would load nothing).
    assert received(pd["decode1"].url) > before
    assert metrics(pd["decode1"].url)["kv_transfer_loads_failed"] == 0
    assert_settled(pd["prefill"].url, pd["decode1"].url)


def test_a_prefix_cached_on_the_consumer_is_not_transferred_again(pd):
    prefill, decode, ref = pd["prefill"].url, pd["decode1"].url, pd["colocated"].url
    a = list(range(1000, 1080))  # 80 tokens: the load covers 79 of them, 5 blocks of 16
    b = a[:64] + list(range(3000, 3030))  # shares a's first 4 blocks; 93 tokens to load, 6 blocks
    for prompt, blocks in ((a, 5), (b, 6 - 4), (a, 5 - 4), (a + [7], 0)):
        body = {"prompt": prompt, **GREEDY}
        start = received(decode)
        assert by_hand(prefill, decode, body)["choices"][0]["text"] == complete(ref, body)["choices"][0]["text"]
        assert received(decode) - start == blocks, prompt
    # a + [7] pulled nothing: the consumer told the producer at once, long before the lease.
    assert_settled(prefill, decode, within_s=LEASE_S / 2)


def test_blocks_nobody_pulls_come_back_when_the_lease_expires(pd):
    prefill = pd["prefill"].url
    expired = metrics(prefill)["kv_transfer_leases_expired"]
    held = complete(prefill, {"prompt": TEXTS[2], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert held["kv_transfer_params"]["remote_block_ids"]
    m = metrics(prefill)
    assert m["kv_transfer_held_requests"] == 1 and m["kv_cache_usage_perc"] > 0
    assert_settled(prefill)
    assert metrics(prefill)["kv_transfer_leases_expired"] == expired + 1
    # The blocks are gone: a late consumer cannot have them, so it recomputes (same output).
    body = {"prompt": TEXTS[2], **GREEDY}
    late = complete(pd["decode1"].url, {**body, "kv_transfer_params": held["kv_transfer_params"]})
    assert late["choices"][0]["text"] == complete(pd["colocated"].url, body)["choices"][0]["text"]


async def _client(router: str, i: int, rng: random.Random) -> str:
    """Complete, stream to the end, leave before any event (mid-prefill or between the two
    phases) or leave mid-decode."""
    kind = ("complete", "stream", "leave-early", "leave-mid-decode")[i % 4]
    prompt = TEXTS[2] * (1 + i % 3) + str(i)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.8, "seed": i, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=router, timeout=120) as client:
        if kind == "complete":
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        elif kind == "leave-early":
            task = asyncio.ensure_future(client.post("/v1/completions", json={**body, "stream": True}))
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            task.cancel()
        else:
            leave_after = rng.randint(2, 6) if kind == "leave-mid-decode" else None
            seen = 0
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if leave_after is not None and seen >= leave_after:
                        break
    return kind


def test_every_block_comes_back_after_a_storm_with_aborts(pd):
    rng = random.Random(19)

    async def storm():
        sem = asyncio.Semaphore(8)

        async def one(i):
            async with sem:
                return await _client(pd["router"].url, i, rng)

        return await asyncio.gather(*(one(i) for i in range(STORM_CLIENTS)))

    kinds = asyncio.run(asyncio.wait_for(storm(), 600))
    assert len(kinds) == STORM_CLIENTS
    assert_settled(pd["prefill"].url, pd["decode1"].url)


def test_a_killed_decode_instance_leaks_nothing_on_the_prefill_side(pd, server_logs):
    prefill = pd["prefill"].url
    decode2 = start_server(server_logs, *ONE_THREAD, "--kv-transfer-config", _config("kv_consumer"),
                           startup_timeout_s=STARTUP_S)
    pd["decode2"] = decode2
    bodies = [{"prompt": TEXTS[2] + str(i), "max_tokens": 300, "ignore_eos": True} for i in range(4)]
    held = [complete(prefill, {**b, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            for b in bodies]

    async def streams():
        async def one(body, params):
            try:
                async with httpx.AsyncClient(base_url=decode2.url, timeout=60) as client:
                    async with client.stream("POST", "/v1/completions", json={
                            **body, "stream": True, "kv_transfer_params": params}) as r:
                        async for _ in r.aiter_lines():
                            pass
            except httpx.HTTPError:
                pass  # cut off with its decode instance

        # Half stream (and pull) before the kill; the rest were never asked for.
        tasks = [asyncio.ensure_future(one(b, h["kv_transfer_params"])) for b, h in zip(bodies[:2], held[:2])]
        await asyncio.sleep(1.0)
        decode2.proc.kill()
        await asyncio.gather(*tasks)

    asyncio.run(asyncio.wait_for(streams(), 300))
    decode2.proc.wait()
    assert_settled(prefill)
    # Later requests are unaffected.
    body = {"prompt": TEXTS[1], **GREEDY}
    assert complete(pd["router"].url, body)["choices"][0]["text"] == complete(pd["colocated"].url, body)["choices"][0]["text"]


def test_a_killed_prefill_instance_falls_back_to_recompute(pd):
    prefill, decode, ref = pd["prefill"].url, pd["decode1"].url, pd["colocated"].url
    body = {"prompt": TEXTS[2] + "!", **GREEDY}
    held = complete(prefill, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    pd["prefill"].proc.kill()
    pd["prefill"].proc.wait()
    failed = metrics(decode)["kv_transfer_loads_failed"]
    want = complete(ref, body)["choices"][0]["text"]
    got = complete(decode, {**body, "kv_transfer_params": held["kv_transfer_params"]})
    assert got["choices"][0]["text"] == want
    assert metrics(decode)["kv_transfer_loads_failed"] == failed + 1
    # With no prefill instance left, the router has the decode instance prefill.
    assert complete(pd["router"].url, body)["choices"][0]["text"] == want
    assert_settled(decode)
