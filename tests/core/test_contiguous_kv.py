"""The contiguous layout's accounting (core/contiguous_kv.py): pages per request, the
budget, regions reused, and the scheduler admitting and preempting by committed pages.
The OS side is tested on a real mapping in tests/test_kv_layouts.py; here memory=None,
the page arithmetic the simulator uses."""
from __future__ import annotations

import pytest

from fake_runner import Driver, FakeRunner, reference_output
from pagedserve.core import CacheConfig, Request, RequestStatus, Scheduler, SchedulerConfig
from pagedserve.core.contiguous_kv import ContiguousKVCacheManager, plan_contiguous

SMOLLM2_STREAM = 3 * 64 * 4  # one token of one layer's K (or V), fp32
SMOLLM2_STREAMS = 30 * 2


def layout(memory_pages: int, regions: int = 4, max_len: int = 64, block_size: int = 4, stream_bytes: int = 1024,
           streams: int = 2):
    # 1 KiB per token per stream: a 4 KiB page holds 4 tokens of a stream.
    return plan_contiguous(memory_pages * 4096, max_len, regions, block_size, stream_bytes, streams)


def manager(memory_pages: int = 64, **kw) -> ContiguousKVCacheManager:
    lay = layout(memory_pages, **kw)
    return ContiguousKVCacheManager(CacheConfig(1, lay.block_size, False), lay, None)


def compute(kv, request: Request, n: int):
    alloc = kv.allocate_slots(request, n)
    assert alloc is not None
    request.num_computed_tokens += n
    request.status = RequestStatus.RUNNING
    return alloc


def test_smollm2_region_is_whole_pages_and_blocks_and_pages_are_finer_than_blocks():
    lay = plan_contiguous(2 << 30, 8190, 128, 16, SMOLLM2_STREAM, SMOLLM2_STREAMS)
    # 768 B a token: 16 tokens are exactly 3 pages, so regions round up to 16 tokens.
    assert lay.region_tokens == 8192 and lay.blocks_per_region == 512
    assert lay.pages_for(1) == 60 and lay.pages_for(5) == 60 and lay.pages_for(6) == 120
    # A request's committed bytes exceed its tokens' by under one page per stream (240 KiB);
    # a 16-token block's worth of slack is 15 tokens x 46,080 B = 691 KiB.
    for n in (1, 17, 100, 1000):
        assert 0 <= lay.pages_for(n) * 4096 - n * lay.bytes_per_token < 60 * 4096


def test_pages_commit_as_tokens_arrive_and_blocks_are_consecutive():
    kv = manager()
    a = Request("a", list(range(6)), 10)
    alloc = compute(kv, a, 6)  # 6 tokens: 2 pages per stream
    assert kv.committed_pages == 4 and alloc.new_block_ids == (0, 1) and alloc.copies == ()
    assert compute(kv, a, 2).new_block_ids == ()  # tokens 6, 7: same pages, same blocks
    assert kv.committed_pages == 4
    assert compute(kv, a, 1).new_block_ids == (2,) and kv.committed_pages == 6
    b = Request("b", list(range(3)), 4)
    compute(kv, b, 3)
    per_region = kv.layout.blocks_per_region
    assert kv.block_ids(b) == (per_region,) and kv.committed_pages == 8
    kv.check_invariants()


def test_budget_refuses_without_changing_anything():
    kv = manager(memory_pages=6)
    a = Request("a", list(range(8)), 8)
    compute(kv, a, 8)  # 4 pages
    b = Request("b", list(range(8)), 8)
    assert kv.allocate_slots(b, 8) is None and not kv.has_blocks(b)
    assert kv.allocate_slots(a, 5) is None and kv.block_ids(a) == (0, 1)  # tokens 8..12 need 2 more pages per stream
    assert kv.committed_pages == 4
    compute(kv, a, 4)  # tokens 8..11: exactly the budget
    assert kv.committed_pages == 6 and kv.num_free_blocks == 0
    kv.check_invariants()


def test_free_returns_to_baseline_and_regions_are_reused_lowest_first():
    kv = manager(regions=3)
    reqs = [Request(str(i), list(range(5)), 4) for i in range(3)]
    for r in reqs:
        compute(kv, r, 5)
    assert kv.allocate_slots(Request("x", [1], 1), 1) is None  # every region is taken
    kv.free(reqs[1])
    kv.free(reqs[0])
    assert kv.committed_pages == 4  # request 2's 2 pages per stream
    again = Request("y", [1, 2], 2)
    compute(kv, again, 2)
    assert kv.block_ids(again) == (0,)  # region 0 again
    kv.free(again)
    kv.free(reqs[2])
    assert kv.committed_pages == 0 and kv.num_free_blocks == kv.num_blocks and kv.usage == 0
    assert kv.peak_committed_pages == 12
    kv.check_invariants()


def test_rollback_keeps_pages_and_reports_lost_blocks():
    kv = manager()
    a = Request("a", list(range(3)), 10)
    compute(kv, a, 3)
    kv.allocate_slots(a, 4)  # the last token and three drafts: positions 3..6
    assert kv.block_ids(a) == (0, 1) and kv.committed_pages == 4
    a.num_computed_tokens = 4  # one draft accepted
    assert kv.rollback(a) is True and kv.block_ids(a) == (0,)  # block 1 left the table
    # Positions 4..6 were written: their pages stay committed until the request ends.
    assert kv.committed_pages == 4 and kv.waste() == pytest.approx(1 - 4 * 1024 * 2 / (4 * 4096))
    kv.check_invariants()


def test_waste_counts_the_partial_page_of_each_stream():
    kv = manager()
    compute(kv, Request("a", list(range(5)), 3), 5)  # 5 KiB per stream in 2 pages
    assert kv.waste() == pytest.approx(1 - 5 / 8)


def test_fit_error_names_the_region_and_the_budget():
    kv = manager(memory_pages=32)  # 64 tokens: 16 pages in each of the 2 streams
    assert kv.fit_error(64) is None
    assert "region of 64 tokens" in kv.fit_error(65)
    assert "kv_cache_memory" in manager(memory_pages=31).fit_error(64)


def test_prefix_caching_is_refused():
    lay = layout(8)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        ContiguousKVCacheManager(CacheConfig(1, 4, True), lay, None)


# -- the scheduler over the contiguous manager ------------------------------------------


def contiguous_scheduler(memory_pages: int, regions: int = 8, max_len: int = 64, **config):
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", regions)
    lay = layout(memory_pages, regions=regions, max_len=max_len)
    cache = CacheConfig(1, lay.block_size, False)
    sched = Scheduler(SchedulerConfig(max_model_len=max_len, **config), cache,
                      kv_cache=ContiguousKVCacheManager(cache, lay, None))
    runner = FakeRunner(regions * lay.blocks_per_region, lay.block_size)
    return sched, Driver(sched, runner)


def test_admission_waits_for_pages_and_never_exceeds_the_budget():
    # Each request: 8 prompt + 8 output tokens = 4 pages per stream, 8 pages in all.
    sched, driver = contiguous_scheduler(memory_pages=12)
    reqs = [Request(str(i), [i * 100 + t for t in range(8)], 8, ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    peak_running = 0
    while sched.has_unfinished_requests():
        driver.step()
        kv = sched.kv_cache
        assert kv.committed_pages <= kv.layout.budget_pages
        peak_running = max(peak_running, len(sched.running))
    assert peak_running >= 2
    for r in reqs:
        assert driver.outputs[r.request_id] == reference_output(r)
    assert sched.kv_cache.committed_pages == 0


def test_growth_past_the_budget_preempts_and_outputs_stay_right():
    sched, driver = contiguous_scheduler(memory_pages=10)
    reqs = [Request(str(i), [i * 100 + t for t in range(4)], 14, ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    driver.run()
    assert sched.num_preemptions > 0
    for r in reqs:
        assert driver.outputs[r.request_id] == reference_output(r)
    assert sched.kv_cache.committed_pages == 0


def test_add_request_refuses_what_never_fits_and_n_above_one():
    sched, _ = contiguous_scheduler(memory_pages=6, max_len=64)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        sched.add_request(Request("big", list(range(10)), 4))  # 14 tokens: 4 pages per stream
    with pytest.raises(ValueError, match="n > 1 needs kv_layout='paged'"):
        sched.add_request(Request("fork", list(range(4)), 2, n=2))
