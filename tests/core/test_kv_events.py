"""The block pool's KV events against the pool itself: replaying them gives exactly
the prefix-cache index after every step, evictions included; nothing is recorded
while no log is attached."""
from __future__ import annotations

import random

from fake_runner import Driver, make_scheduler
from pagedserve.core import BlockPool, Request
from pagedserve.core.block_hash import extend_block_hashes
from pagedserve.core.kv_events import REMOVED, STORED, KVEventLog


def replay(held: set[bytes], events: list[tuple[str, bytes]]) -> set[bytes]:
    for kind, h in events:
        if kind == STORED:
            assert h not in held, "stored twice without a removal between"
            held.add(h)
        else:
            assert kind == REMOVED and h in held, "removed a hash that was not stored"
            held.discard(h)
    return held


def test_register_and_eviction_are_logged_in_order():
    pool = BlockPool(2)
    pool.events = log = KVEventLog()
    a, b = pool.take(2)
    pool.register(a, b"A")
    pool.register(b, b"A")  # a duplicate stays anonymous: no event
    pool.register(b, b"B")
    pool.release([a, b])
    assert log.drain() == [(STORED, b"A"), (STORED, b"B")]
    (reused,) = pool.take(1)  # evicts A, the least recently freed
    pool.register(reused, b"A")  # the same content computed again
    assert log.drain() == [(REMOVED, b"A"), (STORED, b"A")]
    assert log.drain() == []


def test_nothing_is_recorded_without_a_log():
    pool = BlockPool(2)
    a, _ = pool.take(2)
    pool.register(a, b"A")
    pool.release([a])
    pool.events = log = KVEventLog()
    assert pool.cached_hashes() == [b"A"]  # a watcher starts from the index, not from history
    assert log.events == []


def test_replayed_events_equal_the_index_through_a_busy_workload():
    """Shared prefixes on a pool small enough to evict and preempt; after every step the
    events replayed onto the starting snapshot are the index, and the hashes match the
    chained hashes a router computes from the prompt alone."""
    rng = random.Random(0)
    bs = 4
    sched = make_scheduler(num_blocks=24, block_size=bs, max_num_batched_tokens=16, max_num_seqs=4)
    pool = sched.kv_cache.pool
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    driver = Driver(sched)
    held = set(pool.cached_hashes())
    pool.events = log = KVEventLog()
    prompts = {}
    evicted = 0
    for step in range(400):
        if step % 3 == 0 and step < 240:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            rid = f"r{step}"
            prompts[rid] = prompt
            sched.add_request(Request(rid, prompt, rng.randrange(1, 12), ignore_eos=True))
        if not sched.has_unfinished_requests():
            continue
        driver.step()
        events = log.drain()
        evicted += sum(kind == REMOVED for kind, _ in events)
        assert replay(held, events) == set(pool.cached_hashes())
    assert evicted > 0, "the workload never evicted: the test lost its point"
    for rid, prompt in prompts.items():
        router_keys = extend_block_hashes([], prompt, bs, len(prompt) // bs, None)
        assert router_keys == driver.seen[rid].block_hashes[: len(router_keys)]
