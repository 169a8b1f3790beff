"""Both KV layouts implement core/kv_cache.KVCache, member by member, and account the same
way through it: the scheduler and every observer see nothing else of them."""
from __future__ import annotations

import inspect

import pytest

from pagedserve.core import CacheConfig, KVCache, KVCacheManager, Request
from pagedserve.core.contiguous_kv import ContiguousKVCacheManager, plan_contiguous
from pagedserve.core.kv_events import STORED

BLOCK_SIZE = 4
NUM_BLOCKS = 8


def paged() -> KVCacheManager:
    return KVCacheManager(CacheConfig(NUM_BLOCKS, BLOCK_SIZE, True))


def contiguous() -> ContiguousKVCacheManager:
    # 1 KiB per token per stream, 2 streams: a 4-token block is 2 pages, and the 16-page
    # budget is 8 block equivalents, as many as the paged pool's.
    layout = plan_contiguous(16 * 4096, 64, 4, BLOCK_SIZE, 1024, 2)
    return ContiguousKVCacheManager(CacheConfig(1, BLOCK_SIZE, False), layout, None)


LAYOUTS = [pytest.param(paged, id="paged"), pytest.param(contiguous, id="contiguous")]


def protocol_members() -> dict[str, object]:
    return {name: member for name, member in vars(KVCache).items() if not name.startswith("_")}


@pytest.mark.parametrize("make", LAYOUTS)
def test_every_protocol_member_is_there_with_its_kind_and_parameters(make):
    kv = make()
    members = protocol_members()
    assert {"allocate_slots", "free", "usage", "num_free_blocks", "drain_events", "block_map"} <= members.keys()
    for name, member in members.items():
        assert hasattr(kv, name), f"{type(kv).__name__} lacks {name}"
        implementation = inspect.getattr_static(type(kv), name, None)
        if isinstance(member, property):
            # A read-only property is met by a property or a plain (class or instance) attribute.
            assert not inspect.isfunction(implementation), f"{name} is a property in KVCache, a method here"
        else:
            assert inspect.isfunction(implementation), f"{name} is a method in KVCache, not here"
            expected = list(inspect.signature(member).parameters)
            assert list(inspect.signature(implementation).parameters) == expected, name


@pytest.mark.parametrize("make", LAYOUTS)
def test_allocation_and_free_account_the_same_through_the_protocol(make):
    kv: KVCache = make()
    assert (kv.num_blocks, kv.num_free_blocks, kv.usage) == (NUM_BLOCKS, NUM_BLOCKS, 0.0)
    a = Request("a", list(range(6)), 4)
    assert kv.fit_error(a.num_tokens) is None and kv.find_prefix_hit(a).num_tokens == 0
    alloc = kv.allocate_slots(a, 6)
    assert alloc is not None and len(alloc.new_block_ids) == 2 and alloc.copies == ()
    kv.cache_blocks(a, 6)
    a.num_computed_tokens = 6
    assert kv.has_blocks(a) and kv.block_ids(a) == alloc.new_block_ids
    assert (kv.num_free_blocks, kv.usage) == (NUM_BLOCKS - 2, 0.25)
    assert {rid: (list(ids), n) for rid, (ids, n) in kv.block_tables().items()} == {"a": (list(alloc.new_block_ids), 6)}
    big = Request("big", list(range(40)), 4)  # 10 blocks' worth: refused, nothing changed
    assert kv.allocate_slots(big, 40) is None and not kv.has_blocks(big)
    assert kv.num_free_blocks == NUM_BLOCKS - 2
    kv.check_invariants()
    kv.free(a)
    assert (kv.num_free_blocks, kv.usage) == (NUM_BLOCKS, 0.0) and not kv.has_blocks(a) and kv.block_tables() == {}
    kv.check_invariants()


@pytest.mark.parametrize("make", LAYOUTS)
def test_a_missing_capability_is_stated_not_probed(make):
    kv: KVCache = make()
    a = Request("a", list(range(5)), 4)
    kv.record_events(True)
    assert kv.allocate_slots(a, 5) is not None
    a.num_computed_tokens = 5
    kv.cache_blocks(a, 5)  # one full block
    events = kv.drain_events()
    assert events == ([(STORED, a.block_hashes[0])] if kv.indexes_prefixes else [])
    assert kv.cached_hashes() == [h for _, h in events] and kv.drain_events() == []
    kv.record_events(False)
    kv.free(a)
    assert kv.drain_events() == []
    block_map = kv.block_map()  # None: nothing to draw per block
    assert block_map is None or len(block_map.ref_counts) == kv.num_blocks
    if not kv.supports_forks:
        with pytest.raises(ValueError, match="n > 1"):
            kv.fork(a, a.make_child(1, BLOCK_SIZE))
    if not kv.indexes_prefixes:
        with pytest.raises(ValueError, match="no prefix cache"):
            kv.install_cached_prefix([b"h"])


def test_a_peak_of_committed_bytes_only_where_memory_is_committed_as_tokens_arrive():
    assert paged().peak_committed_bytes is None  # its tensors are committed whole before any request
    kv = contiguous()
    assert kv.peak_committed_bytes == 0
    a = Request("a", list(range(6)), 4)
    assert kv.allocate_slots(a, 6) is not None
    kv.free(a)
    assert kv.peak_committed_bytes == 2 * 2 * 4096  # 6 tokens of 1 KiB: 2 pages in each of 2 streams
