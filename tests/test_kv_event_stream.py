"""The server's KV event stream (GET /v1/kv_events) on the real engine, and the router's
prompt keys against the engine's own block hashes for the same request.

The stream: a subscriber's snapshot plus the events after it replay to exactly the
block pool's prefix-cache index, through evictions; nothing is recorded before the
first subscriber or after the last. The keys: the router tokenises a completion or a
chat body (with and without a cache salt) and its chained hashes are the ones the
engine indexed for that request.
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine_utils import KV_BYTES_PER_BLOCK, make_llm
from pagedserve import SamplingParams
from pagedserve.core.block_hash import extend_block_hashes
from pagedserve.engine.async_engine import AsyncEngine, GenerationRequest
from pagedserve.entrypoints.openai.kv_events_endpoint import KVEventHub
from pagedserve.model.loader import load_model
from pagedserve.router.prompt_keys import PromptKeyer

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def decode(message: str) -> dict:
    assert message.startswith("data: ") and message.endswith("\n\n"), message
    return json.loads(message[6:])


def test_snapshot_and_events_replay_to_the_index_through_evictions(loaded):
    llm = make_llm(loaded, kv_cache_memory=24 * KV_BYTES_PER_BLOCK)
    pool = llm.engine.scheduler.kv_cache.pool
    prompts = [[(7 * g + i) % 4000 + 10 for i in range(70)] for g in range(6)]  # 4 full blocks each

    async def run(engine: AsyncEngine, rid: str, prompt: list[int]) -> None:
        async for _ in engine.submit([GenerationRequest(rid, prompt, PARAMS, time.monotonic())]):
            pass

    async def scenario() -> tuple[set[bytes], int]:
        engine = AsyncEngine(llm.engine)
        hub = KVEventHub(engine)
        engine.start()
        try:
            await run(engine, "before", prompts[0])
            assert pool.events is None, "recording before anyone subscribed"
            stream = hub.stream(hub.subscribe())
            snapshot = decode(await anext(stream))
            assert snapshot["type"] == "snapshot" and snapshot["block_size"] == 16
            held = {bytes.fromhex(h) for h in snapshot["hashes"]}
            assert held == set(pool.cached_hashes()) and len(held) == 4
            await asyncio.gather(*(run(engine, f"r{i}", p) for i, p in enumerate(prompts * 2)))
            removed = 0
            # Every step's batch was posted before the deltas that ended the requests.
            while True:
                batch = decode(await asyncio.wait_for(anext(stream), 5))
                for kind, h in batch["events"]:
                    if kind == "stored":
                        held.add(bytes.fromhex(h))
                    else:
                        removed += 1
                        held.remove(bytes.fromhex(h))
                if held == set(pool.cached_hashes()):
                    break
            await stream.aclose()
            for _ in range(100):
                if pool.events is None:
                    break
                await asyncio.sleep(0.02)
            assert pool.events is None, "still recording after the last subscriber left"
            return held, removed
        finally:
            await engine.close()

    held, removed = asyncio.run(scenario())
    assert held == set(pool.cached_hashes())
    assert removed > 0, "a 24-block pool should have evicted"


def test_router_keys_are_the_engine_hashes_for_the_same_prompt(loaded):
    llm = make_llm(loaded)
    engine = llm.engine
    keyer = PromptKeyer(engine.tokenizer)
    text = "You are a careful assistant who answers in full sentences. " * 4 + "What is paged attention?"
    messages = [{"role": "system", "content": "You are a careful assistant. " * 6},
                {"role": "user", "content": "What is paged attention?"}]
    pool = engine.scheduler.kv_cache.pool
    cases = [
        ("/v1/completions", {"prompt": text}, text),
        ("/v1/completions", {"prompt": text, "cache_salt": "tenant-a"}, text),
        ("/v1/chat/completions", {"messages": messages}, None),
    ]
    for path, body, engine_prompt in cases:
        keys = keyer.keys(path, json.dumps(body).encode())
        if engine_prompt is None:  # what `pagedserve chat` and the server's chat path send
            rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            engine_prompt = engine.tokenizer.encode(rendered, add_special_tokens=False)
        rid = engine.add_request(engine_prompt, PARAMS, cache_salt=body.get("cache_salt"))
        request = engine.scheduler.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
        hashes = keys.hashes(16)
        assert keys.token_ids == request.prompt_token_ids
        assert len(hashes) == (len(request.prompt_token_ids) - 1) // 16 >= 3
        assert hashes == request.block_hashes[: len(hashes)]
        assert set(hashes) <= set(pool.cached_hashes())
        assert hashes == extend_block_hashes([], keys.token_ids, 16, len(hashes), body.get("cache_salt"))
    salted = keyer.keys("/v1/completions", json.dumps(cases[1][1]).encode()).hashes(16)
    plain = keyer.keys("/v1/completions", json.dumps(cases[0][1]).encode()).hashes(16)
    assert not set(salted) & set(plain), "a tenant's salt must change every key of its prompt"
    bad = keyer.keys("/v1/completions", b"{not json")
    assert bad.token_ids == [] and bad.hashes(16) == []


def test_a_failing_command_on_the_engine_thread_costs_only_itself(loaded):
    # Commands the HTTP side sends the engine thread (KV events, the dashboard's switches)
    # once stopped the engine when one raised: GET /v1/kv_events on the contiguous layout.
    llm = make_llm(loaded)

    def broken(_engine) -> None:
        raise AttributeError("a command's own bug")

    async def scenario() -> list[int]:
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            engine.call_on_thread(broken)
            tokens = []
            async for delta in engine.submit([GenerationRequest("after", [1, 2, 3], PARAMS, time.monotonic())]):
                tokens.extend(t for s in delta.samples for t in s.token_ids)
            return tokens
        finally:
            await engine.close()

    assert len(asyncio.run(scenario())) == PARAMS.max_tokens
