from __future__ import annotations

from pagedserve.core import BlockPool


def test_take_hands_out_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c, d = pool.take(4)
    assert pool.num_free == 0
    pool.release([c, a])  # a tail-first free of a table [a, c]
    pool.release([d])
    assert [blk.block_id for blk in pool.take(3)] == [c.block_id, a.block_id, d.block_id]


def test_freed_block_keeps_its_hash_until_reused():
    pool = BlockPool(2)
    (block,) = pool.take(1)
    pool.register(block, b"h")
    pool.release([block])
    assert pool.lookup(b"h") is block and pool.num_free == 2
    pool.acquire([block])  # revived by a prefix hit: leaves the free queue
    assert pool.num_free == 1 and block.ref_cnt == 1
    pool.release([block])
    other, reused = pool.take(2)  # the never-used block goes first, then the cached one
    assert reused is block and block.block_hash is None and pool.lookup(b"h") is None
    pool.check_invariants()


def test_register_keeps_the_first_block_for_a_hash():
    pool = BlockPool(2)
    first, second = pool.take(2)
    pool.register(first, b"h")
    pool.register(second, b"h")
    assert pool.lookup(b"h") is first and second.block_hash is None
    pool.check_invariants()


def test_shared_block_returns_to_the_queue_only_at_zero_references():
    pool = BlockPool(1)
    (block,) = pool.take(1)
    pool.acquire([block])
    pool.release([block])
    assert pool.num_free == 0
    pool.release([block])
    assert pool.num_free == 1
    pool.check_invariants()
