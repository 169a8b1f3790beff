"""The dashboard's frames against the engine's own accounting, step by step: block
counts equal stats(), owners match the tables, forks mark shared and copied blocks,
preempted requests show as such, step records add up to the schedule, and nothing is
recorded while nobody watches."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest

from engine_utils import KV_BYTES_PER_BLOCK, make_llm
from pagedserve import SamplingParams
from pagedserve.engine.async_engine import AsyncEngine, GenerationRequest
from pagedserve.engine.dashboard_feed import CACHED, COPIED, FREE, SHARED, USED, DashboardFeed
from pagedserve.model.loader import load_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def check_frame(frame: dict, engine) -> Counter:
    """Assert the frame agrees with stats() and the KV manager's tables; its state counts."""
    stats = engine.stats()
    blocks = frame["blocks"]
    counts = Counter(blocks["state"])
    assert len(blocks["state"]) == stats["kv_total_blocks"] == len(blocks["owner"]) == len(blocks["ref"])
    assert counts[FREE] + counts[CACHED] == stats["kv_free_blocks"] == frame["stats"]["kv_free_blocks"]
    assert counts[USED] + counts[SHARED] + counts[COPIED] == stats["kv_total_blocks"] - stats["kv_free_blocks"]
    tables = engine.scheduler.kv_cache.block_tables()
    assert [s["id"] for s in frame["seqs"]] == list(tables)
    for seq, (ids, num_tokens) in zip(frame["seqs"], tables.values()):
        assert (seq["blocks"], seq["tokens"]) == (len(ids), num_tokens)
    for i, code in enumerate(blocks["state"]):
        assert (blocks["owner"][i] >= 0) == (code in (USED, SHARED, COPIED)), (i, code)
        assert (blocks["ref"][i] > 1) == (code == SHARED) or code == COPIED, (i, code)
    return counts


def test_frames_match_engine_stats_at_every_step(loaded):
    llm = make_llm(loaded)
    engine = llm.engine
    feed = DashboardFeed()
    feed.watch(True)
    engine.add_request(PROMPT + "Tell me more.", SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=8, ignore_eos=True, seed=1, temperature=1.0))
    seen: Counter = Counter()
    scheduled_tokens = recorded_tokens = 0
    while engine.has_unfinished_requests():
        engine.step()
        feed.record_step(engine, 0.01)
        scheduled_tokens += engine.last_scheduled.num_scheduled_tokens
        frame = feed.build_frame(engine)
        assert frame is not None
        seen.update(check_frame(frame, engine))
        (step,) = frame["steps"]
        recorded_tokens += step["decode"] + step["prefill"] + step["draft"]
        assert step["rows"] == len(engine.last_scheduled.scheduled)
    assert recorded_tokens == scheduled_tokens
    # The fork shares the prompt's blocks and copies the partial one on divergence.
    assert seen[SHARED] > 0 and seen[COPIED] > 0
    final = check_frame(feed.build_frame(engine) or frame, engine)
    assert final[USED] == final[SHARED] == 0 and final[CACHED] > 0
    assert feed.build_frame(engine) is None  # nothing changed since


def test_unwatched_feed_records_nothing_and_hides_prompts(loaded):
    llm = make_llm(loaded)
    engine = llm.engine
    feed = DashboardFeed()
    secret = "my secret prompt about zebras"
    engine.add_request(secret, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    frame = feed.build_frame(engine)
    assert frame["num_steps"] == 0 and frame["steps"] == []
    assert "zebras" not in json.dumps(frame)
    shown = DashboardFeed(show_prompts=True).build_frame(engine)
    assert shown["requests"][0]["prompt"].startswith(secret)


def test_queues_show_preempted_requests(loaded):
    # Three requests that each grow to 3 blocks in a pool of 6: one must be preempted.
    llm = make_llm(loaded, kv_cache_memory=6 * KV_BYTES_PER_BLOCK, max_num_batched_tokens=64,
                   max_num_seqs=8)
    engine = llm.engine
    feed = DashboardFeed()
    feed.watch(True)
    for i in range(3):
        engine.add_request(f"Request {i}: " + PROMPT[:60], SamplingParams(max_tokens=24, ignore_eos=True))
    states: set[str] = set()
    while engine.has_unfinished_requests():
        engine.step()
        feed.record_step(engine, 0.01)
        frame = feed.build_frame(engine)
        check_frame(frame, engine)
        states.update(r["state"] for r in frame["requests"])
    assert engine.stats()["num_preemptions"] > 0
    assert {"running", "preempted"} <= states


def test_engine_thread_builds_frames_only_when_asked(loaded):
    """Through the AsyncEngine: unwatched, the thread records no step; watched, a frame
    asked for while the engine idles still comes (the request wakes the thread)."""
    llm = make_llm(loaded)
    feed = DashboardFeed()
    frames: list[dict] = []

    async def scenario() -> None:
        engine = AsyncEngine(llm.engine)
        engine.attach_feed(feed, frames.append)
        engine.start()
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            stream = engine.submit([GenerationRequest("unwatched", [1, 2, 3, 4], params, time.monotonic())])
            async for _ in stream:
                pass
            feed.watch(True)
            stream = engine.submit([GenerationRequest("watched", [5, 6, 7, 8], params, time.monotonic())])
            async for _ in stream:
                pass
            engine.request_frame()
            while not frames:
                await asyncio.sleep(0.01)
        finally:
            await engine.close()

    asyncio.run(scenario())
    (frame,) = frames
    # Only the watched request's steps were recorded (a 4-token prompt, 4 outputs: 4 steps).
    assert frame["num_steps"] == len(frame["steps"]) == 4
    assert sum(s["decode"] for s in frame["steps"]) == 3 and sum(s["prefill"] for s in frame["steps"]) == 4
