from __future__ import annotations

import pytest

from fake_runner import Driver, make_scheduler, reference_output
from pagedserve.core import CacheConfig, KVCacheManager, Request, RequestStatus
from pagedserve.core import block_hash


def manager(num_blocks: int = 16, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, caching))


def compute(kv: KVCacheManager, request: Request, n: int, hit=None):
    """What the scheduler does for one row: allocate, index full blocks, advance."""
    alloc = kv.allocate_slots(request, n, hit)
    assert alloc is not None
    start = request.num_computed_tokens + (hit.num_tokens if hit else 0)
    kv.cache_blocks(request, start + n)
    request.num_computed_tokens = start + n
    request.status = RequestStatus.RUNNING
    return alloc


def test_allocate_grows_the_table_a_block_at_a_time():
    kv = manager()
    r = Request("a", list(range(6)), 10)
    alloc = compute(kv, r, 6)
    assert len(alloc.new_block_ids) == 2 and alloc.copies == ()
    assert compute(kv, r, 2).new_block_ids == ()  # positions 6, 7 fit block 1
    assert len(compute(kv, r, 1).new_block_ids) == 1
    assert kv.block_ids(r)[:2] == alloc.new_block_ids
    kv.check_invariants()


def test_failed_allocation_changes_nothing():
    kv = manager(num_blocks=3)
    a = Request("a", list(range(8)), 4)
    compute(kv, a, 8)
    b = Request("b", list(range(100, 112)), 4)
    before = (kv.num_free_blocks, kv.prefix_cache_queries)
    assert kv.allocate_slots(b, 12, kv.find_prefix_hit(b)) is None
    assert (kv.num_free_blocks, kv.prefix_cache_queries) == before and not kv.has_blocks(b)
    table = kv.block_ids(a)
    assert kv.allocate_slots(a, 5) is None and kv.block_ids(a) == table
    kv.check_invariants()


def test_free_returns_everything_tail_first():
    kv = manager(num_blocks=4)
    a = Request("a", list(range(12)), 4)
    compute(kv, a, 12)
    table = kv.block_ids(a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and not kv.has_blocks(a)
    # The never-used block is reused first, then a's tail, then its head.
    order = [b.block_id for b in kv.pool.take(4)]
    assert order[1:] == list(reversed(table))


def test_hit_is_whole_blocks_capped_below_num_tokens():
    kv = manager(block_size=4)
    a = Request("a", list(range(8)), 4)
    compute(kv, a, 8)
    same = Request("b", list(range(8)), 4)
    assert kv.find_prefix_hit(same).num_tokens == 4  # 8 tokens: a hit of 8 would leave nothing to compute
    longer = Request("c", list(range(9)), 4)
    assert kv.find_prefix_hit(longer).num_tokens == 8


def test_only_full_blocks_are_indexed():
    kv = manager(block_size=4)
    a = Request("a", list(range(6)), 4)
    compute(kv, a, 6)
    assert kv.pool.num_cached == 1
    assert kv.find_prefix_hit(Request("b", list(range(10)), 4)).num_tokens == 4


def test_cache_salt_separates_tenants():
    kv = manager(block_size=4)
    compute(kv, Request("a", list(range(9)), 4, cache_salt="tenant-1"), 9)
    assert kv.find_prefix_hit(Request("b", list(range(9)), 4, cache_salt="tenant-1")).num_tokens == 8
    assert kv.find_prefix_hit(Request("c", list(range(9)), 4, cache_salt="tenant-2")).num_tokens == 0
    assert kv.find_prefix_hit(Request("d", list(range(9)), 4)).num_tokens == 0


def test_hash_is_a_chain_over_the_whole_prefix():
    kv = manager(block_size=2)
    compute(kv, Request("a", [1, 2, 3, 4, 5], 4), 5)
    # Same second block, different first block: no hit on the second either.
    assert kv.find_prefix_hit(Request("b", [9, 9, 3, 4, 5], 4)).num_tokens == 0
    h0 = block_hash.hash_block(block_hash.ROOT_HASH, [1, 2])
    assert kv.pool.lookup(block_hash.hash_block(h0, [3, 4])) is not None


def test_each_full_block_is_hashed_once(monkeypatch):
    calls = []
    real = block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block", lambda *a: calls.append(a) or real(*a))
    kv = manager(num_blocks=32, block_size=4)
    r = Request("a", list(range(10)), 40)
    kv.find_prefix_hit(r)  # admission lookup hashes blocks 0, 1
    compute(kv, r, 10)
    for t in range(30):  # decode 30 tokens one by one
        r.append_output_token(1000 + t)
        compute(kv, r, 1)
    assert len(calls) == r.num_computed_tokens // 4 == len(r.block_hashes)


def test_hit_revives_free_cached_blocks_and_counts_tokens():
    kv = manager(num_blocks=8, block_size=4)
    a = Request("a", list(range(13)), 4)
    compute(kv, a, 13)
    kv.free(a)
    b = Request("b", list(range(13)) + [99], 4)
    hit = kv.find_prefix_hit(b)
    assert hit.num_tokens == 12
    compute(kv, b, b.num_tokens - hit.num_tokens, hit)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (14, 12)
    kv.check_invariants()


def test_fork_shares_blocks_and_copies_only_the_partial_tail():
    kv = manager(block_size=4)
    parent = Request("p", list(range(10)), 8, n=3)
    compute(kv, parent, 10)
    parent.fork_pending = False
    children = [parent.make_child(i, 4) for i in (1, 2)]
    for child in children:
        kv.fork(parent, child)
    full0, full1, partial = (kv.pool.blocks[i] for i in kv.block_ids(parent))
    assert (full0.ref_cnt, full1.ref_cnt, partial.ref_cnt) == (3, 3, 3)
    kv.check_invariants()
    copies = []
    for r, token in zip((parent, *children), (7, 8, 9)):
        r.append_output_token(token)
        copies += compute(kv, r, 1).copies
    # Two of three writers copy; the last finds the block private and writes in place.
    assert copies == [(partial.block_id, copies[0][1]), (partial.block_id, copies[1][1])]
    assert full0.ref_cnt == full1.ref_cnt == 3 and partial.ref_cnt == 1
    tables = [kv.block_ids(r) for r in (parent, *children)]
    assert len({t[2] for t in tables}) == 3 and len({t[:2] for t in tables}) == 1
    kv.check_invariants()


def test_fork_on_a_block_boundary_copies_nothing():
    kv = manager(block_size=4)
    parent = Request("p", list(range(8)), 8, n=2)
    compute(kv, parent, 8)
    child = parent.make_child(1, 4)
    kv.fork(parent, child)
    for r in (parent, child):
        r.append_output_token(5)
        assert compute(kv, r, 1).copies == ()
    kv.check_invariants()


def test_waste_counts_empty_slots_of_partial_blocks_once():
    kv = manager(block_size=4)
    parent = Request("p", list(range(5)), 8, n=2)
    compute(kv, parent, 5)  # 2 blocks, 3 empty slots
    assert kv.waste() == pytest.approx(3 / 8)
    kv.fork(parent, parent.make_child(1, 4))  # shares both blocks: still 3 of 8 slots empty
    assert kv.waste() == pytest.approx(3 / 8) and kv.usage == 2 / 16


def test_prefix_hits_in_one_batch_after_free_and_after_eviction():
    """End to end through the scheduler, with the fake runner verifying every read."""
    prompt = list(range(100, 140))  # 10 blocks of 4
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=128)
    driver = Driver(sched)
    a, b = Request("a", prompt, 3), Request("b", prompt, 3)
    sched.add_request(a)
    sched.add_request(b)
    driver.run()
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 36)  # same step: b reuses a's blocks
    assert driver.outputs["a"] == driver.outputs["b"] == reference_output(a)

    c = Request("c", prompt, 3)
    sched.add_request(c)
    driver.run()
    assert c.num_cached_tokens == 36  # after both were freed

    # d takes 22 of the 24 blocks, all from the front of the free queue. c freed its
    # table tail first, so the two most recently freed blocks, the survivors, are
    # the first two blocks of the shared prompt.
    d = Request("d", list(range(500, 588)), 1)
    sched.add_request(d)
    driver.step()
    assert d.is_finished and sched.kv_cache.num_free_blocks == 24
    e = Request("e", prompt, 3)
    sched.add_request(e)
    driver.run()
    assert e.num_cached_tokens == 8
    assert driver.outputs["e"] == reference_output(e)
