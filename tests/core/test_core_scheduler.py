from __future__ import annotations

import pytest

from fake_runner import Driver, make_scheduler, reference_output
from pagedserve.core import Request, RequestStatus


def req(rid: str, prompt_len: int, max_tokens: int, base: int = 0, **kw) -> Request:
    # Distinct token ids per base, so prompts only share a prefix when asked to.
    return Request(rid, [base + i for i in range(prompt_len)], max_tokens, ignore_eos=True, **kw)


def rows(out) -> dict[str, int]:
    return {r.request_id: r.num_new_tokens for r in out.scheduled}


# -- the step ------------------------------------------------------------------------


def test_schedule_advances_computed_tokens_and_update_appends_samples():
    sched = make_scheduler()
    r = req("a", 10, 3)
    sched.add_request(r)
    driver = Driver(sched)
    out, updates = driver.step()
    (row,) = out.scheduled
    assert (row.start, row.num_new_tokens, row.is_new, row.num_samples) == (0, 10, True, 1)
    assert r.num_computed_tokens == 10 and r.num_output_tokens == 1
    assert [u.new_token_ids for u in updates] == [r.output_token_ids]
    out, _ = driver.step()
    assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens, out.scheduled[0].is_new) == (10, 1, False)
    driver.run()
    assert driver.outputs["a"] == reference_output(r) and driver.finish_reasons["a"] == "length"
    out = sched.schedule()
    assert out.finished_request_ids == ["a"] and out.is_empty
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_new_request_gets_its_table_once_then_only_new_blocks():
    sched = make_scheduler(block_size=4)
    sched.add_request(req("a", 6, 8))
    driver = Driver(sched)
    out, _ = driver.step()
    assert out.scheduled[0].new_block_ids == out.scheduled[0].block_ids and len(out.scheduled[0].block_ids) == 2
    diffs = []
    for _ in range(4):  # positions 6, 7 fit block 1; 8 needs block 2
        out, _ = driver.step()
        diffs.append((out.scheduled[0].new_block_ids, out.scheduled[0].block_ids))
    assert [len(d[0]) for d in diffs] == [0, 0, 1, 0] and all(d[1] is None for d in diffs)


def test_decodes_come_first_and_chunks_take_the_rest_of_the_budget():
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=8)
    driver = Driver(sched)
    for i in range(3):
        sched.add_request(req(f"d{i}", 4, 50, base=100 * i))
    driver.step()
    sched.add_request(req("long", 100, 5, base=1000))
    out, _ = driver.step()
    assert rows(out) == {"d0": 1, "d1": 1, "d2": 1, "long": 29}
    out, _ = driver.step()
    assert [r.request_id for r in out.scheduled] == ["d0", "d1", "d2", "long"]
    assert rows(out)["long"] == 29 and out.scheduled[-1].num_samples == 0


def test_long_prefill_threshold_lets_prompts_progress_together():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    sched.add_request(req("a", 100, 2))
    sched.add_request(req("b", 100, 2, base=500))
    out, _ = Driver(sched).step()
    assert rows(out) == {"a": 16, "b": 16}


def test_max_num_seqs_caps_rows():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", 3, 4, base=10 * i))
    driver = Driver(sched)
    out, _ = driver.step()
    assert set(rows(out)) == {"r0", "r1"}
    assert len(sched.waiting) == 2
    driver.run()


@pytest.mark.parametrize("policy", ["chunked", "continuous"])
def test_decodes_during_a_4000_token_prefill(policy):
    """Chunked prefill keeps every decode advancing every step while a long prompt is
    computed; without it the prompt takes a step to itself and the decodes stall."""
    sched = make_scheduler(num_blocks=2048, block_size=16, max_num_batched_tokens=512, max_num_seqs=8, policy=policy)
    driver = Driver(sched)
    decoders = [req(f"d{i}", 20, 400, base=1000 * i) for i in range(4)]
    for d in decoders:
        sched.add_request(d)
    driver.step()
    long = req("long", 4000, 4, base=50_000)
    sched.add_request(long)
    steps = []
    while long.num_output_tokens == 0:
        out, _ = driver.step()
        steps.append(rows(out))
    decoding_every_step = all(all(f"d{i}" in s for i in range(4)) for s in steps)
    if policy == "chunked":
        assert len(steps) == 8  # 4000 tokens in chunks of 512 - 4
        assert decoding_every_step and all(sum(s.values()) <= 512 for s in steps)
    else:
        assert steps[-1] == {"long": 4000}  # the whole prompt, alone: the decodes skip it
        assert not decoding_every_step
    driver.run()
    assert all(driver.outputs[d.request_id] == reference_output(d) for d in decoders)


def test_continuous_mixes_prompts_that_fit_beside_the_decodes():
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=8, policy="continuous")
    driver = Driver(sched)
    for i in range(2):
        sched.add_request(req(f"d{i}", 4, 50, base=100 * i))
    driver.step()
    sched.add_request(req("fits", 30, 2, base=1000))
    sched.add_request(req("too-long", 31, 2, base=2000))
    out, _ = driver.step()
    assert rows(out) == {"d0": 1, "d1": 1, "fits": 30}
    out, _ = driver.step()  # 31 tokens cannot sit beside 3 decodes: a prefill step
    assert rows(out) == {"too-long": 31}
    out, _ = driver.step()
    assert rows(out) == {"d0": 1, "d1": 1, "fits": 1, "too-long": 1}


# -- preemption ---------------------------------------------------------------------------


def test_preemption_recomputes_and_resumes_to_the_same_tokens():
    def workload():
        return [Request(f"r{i}", [7 * i + j for j in range(5 + 3 * i)], 12 + i, ignore_eos=True) for i in range(6)]

    roomy = make_scheduler(num_blocks=200, block_size=4)
    tight = make_scheduler(num_blocks=12, block_size=4)
    runs = []
    for sched in (roomy, tight):
        driver = Driver(sched)
        for r in workload():
            sched.add_request(r)
        driver.run()
        runs.append(driver.outputs)
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert runs[0] == runs[1]
    assert all(runs[1][f"r{i}"] == reference_output(r) for i, r in enumerate(workload()))


def test_fcfs_preempts_the_latest_admitted_and_admits_nothing_that_step():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    a, b = req("a", 8, 20), req("b", 8, 20, base=100)
    sched.add_request(a)
    sched.add_request(b)
    driver = Driver(sched)
    while sched.kv_cache.num_free_blocks:
        driver.step()
    sched.add_request(req("c", 3, 2, base=200))  # would fit in b's blocks once freed
    preempted = []
    while not preempted:
        out, _ = driver.step()
        preempted = out.preempted_request_ids
    assert preempted == ["b"] and b.status is RequestStatus.PREEMPTED
    assert "b" not in rows(out) and "c" not in rows(out)
    assert sched.waiting.peek() is b and b.num_computed_tokens == 0 and b.num_output_tokens > 0
    assert (b.num_preemptions, sched.stats().num_preemptions) == (1, 1)
    driver.run()
    assert driver.outputs["b"] == reference_output(b)


def test_priority_preempts_the_least_important():
    sched = make_scheduler(num_blocks=8, block_size=4, scheduling_policy="priority")
    low = req("low", 8, 20, priority=5, arrival_time=0.0)
    high = req("high", 7, 20, base=100, priority=0, arrival_time=1.0)
    sched.add_request(low)
    sched.add_request(high)
    driver = Driver(sched)
    out, _ = driver.step()
    assert [r.request_id for r in out.scheduled] == ["high", "low"]  # admitted by priority
    while not out.preempted_request_ids:
        out, _ = driver.step()
    assert out.preempted_request_ids == ["low"]
    driver.run()
    assert driver.outputs["low"] == reference_output(low)


def test_a_waiting_high_priority_request_takes_the_seat_of_the_lowest_running():
    """vLLM's scheduler, an open bug there: with every seat taken, a higher-priority arrival
    waits for a low one to finish. Here it is admitted the next step; the victim is the
    lowest priority (latest arrival on ties), resumes at its own place in the queue, ahead
    of later arrivals of its class, and ends with the tokens it would have had."""
    sched = make_scheduler(max_num_seqs=3, num_blocks=64, block_size=4, scheduling_policy="priority")
    driver = Driver(sched)
    running = [req(f"low{i}", 4, 30, base=10 * i, priority=5 if i else 3, arrival_time=float(i)) for i in range(3)]
    for r in running:
        sched.add_request(r)
    driver.step()
    driver.step()
    sched.add_request(req("urgent", 4, 4, base=100, priority=0, arrival_time=10.0))
    sched.add_request(req("late-low", 4, 4, base=200, priority=5, arrival_time=11.0))
    out, _ = driver.step()
    assert out.preempted_request_ids == ["low2"]
    assert "urgent" in rows(out) and "late-low" not in rows(out)
    assert [r.request_id for r in sched.waiting] == ["low2", "late-low"]
    driver.run()
    for r in running:
        assert driver.outputs[r.request_id] == reference_output(r)
    sched.check_invariants()


def test_priority_preemption_frees_blocks_and_each_victim_at_most_once():
    # Three 6-token prompts hold 6 of 8 blocks; a 12-token prompt needs 3.
    sched = make_scheduler(max_num_seqs=8, num_blocks=8, block_size=4, scheduling_policy="priority")
    driver = Driver(sched)
    low = [req(f"low{i}", 6, 12, base=10 * i, priority=5, arrival_time=float(i)) for i in range(3)]
    for r in low:
        sched.add_request(r)
    driver.step()
    urgent = [req(f"urgent{i}", 12, 3, base=100 + 20 * i, priority=0, arrival_time=10.0 + i) for i in range(4)]
    sched.add_request(urgent[0])
    out, _ = driver.step()
    assert out.preempted_request_ids == ["low2"] and rows(out)["urgent0"] == 12
    for r in urgent[1:]:
        sched.add_request(r)
    driver.run()
    # Each low request gave way at most once (the aging rule), and every output is its own.
    assert [r.num_priority_preemptions for r in low] == [1, 1, 1]
    for r in (*low, *urgent):
        assert driver.outputs[r.request_id] == reference_output(r)
    sched.check_invariants()


def test_fcfs_never_preempts_for_an_arrival():
    sched = make_scheduler(max_num_seqs=2, num_blocks=64, block_size=4)
    driver = Driver(sched)
    for i in range(2):
        sched.add_request(req(f"r{i}", 4, 10, base=10 * i, priority=5))
    driver.step()
    sched.add_request(req("urgent", 4, 4, base=100, priority=0))
    out, _ = driver.step()
    assert not out.preempted_request_ids and "urgent" not in rows(out)


def test_waiting_queue_orders_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy="priority")
    for rid, prio, t in [("late-urgent", 0, 3.0), ("early", 1, 1.0), ("early-urgent", 0, 2.0)]:
        sched.add_request(req(rid, 2, 1, priority=prio, arrival_time=t))
    order = [next(iter(rows(Driver(sched).step()[0]))) for _ in range(3)]
    assert order == ["early-urgent", "late-urgent", "early"]


# -- parallel sampling ------------------------------------------------------------------


def test_parallel_sampling_forks_shares_and_copies_the_partial_block():
    sched = make_scheduler(num_blocks=64, block_size=4)
    parent = Request("p", list(range(10)), 6, n=3, ignore_eos=True)
    sched.add_request(parent)
    driver = Driver(sched)
    out, updates = driver.step()
    assert out.scheduled[0].num_samples == 3
    assert [u.request_id for u in updates] == ["p", "p#1", "p#2"]
    children = [u.request for u in updates[1:]]
    assert all(c.parent_id == "p" and c.n == 1 for c in children) and [c.index for c in children] == [1, 2]
    shared = sched.kv_cache.block_ids(parent)
    assert all(sched.kv_cache.block_ids(c) == shared for c in children)
    out, _ = driver.step()
    # Position 10 lies in the third block (2 of 4 slots used): two writers copy it.
    assert [src for src, _ in out.block_copies] == [shared[2], shared[2]]
    by_id = {r.request_id: r for r in out.scheduled}
    assert by_id["p"].block_ids is not None and by_id["p#1"].is_new and by_id["p#2"].is_new
    driver.run()
    for i, r in enumerate((parent, *children)):
        assert driver.outputs[r.request_id] == reference_output(parent, index=i)
    assert sched.kv_cache.num_free_blocks == 64


def test_parallel_sampling_reserves_n_seats():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(Request("p", [1, 2, 3], 4, n=3))
    sched.add_request(req("a", 3, 4, base=10))
    sched.add_request(req("b", 3, 4, base=20))
    out, _ = Driver(sched).step()
    assert set(rows(out)) == {"p", "a"}


# -- rejection and aborts ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("big", list(range(60)), 10), r"70 tokens needs 18 KV blocks of 4; the pool has 16"),
        (Request("long", list(range(60)), 30), r"= 90 exceeds max_model_len \(80\)"),
        (Request("wide", [1], 2, n=5), r"n \(5\) exceeds max_num_seqs \(4\)"),
        (Request("a#1", [1], 2), "reserved"),
    ],
)
def test_impossible_requests_are_rejected_and_never_block_the_queue(request_, message):
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_model_len=80)
    with pytest.raises(ValueError, match=message):
        sched.add_request(request_)
    ok = req("ok", 4, 2)
    sched.add_request(ok)
    Driver(sched).run()
    assert ok.status is RequestStatus.FINISHED_LENGTH


def test_duplicate_live_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(req("a", 2, 2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", 2, 2))


def _abort_and_check(sched, driver, rid, expected_ids):
    aborted = sched.abort(rid)
    assert sorted(r.request_id for r in aborted) == sorted(expected_ids)
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    sched.check_invariants()
    assert all(not sched.kv_cache.has_blocks(r) for r in aborted)
    out, _ = driver.step()
    assert set(expected_ids) <= set(out.finished_request_ids)
    assert not set(expected_ids) & set(rows(out))


def test_abort_in_every_state():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    driver = Driver(sched)
    running = req("decoding", 4, 50)
    mid_prefill = req("mid-prefill", 60, 5, base=100)
    waiting = req("waiting", 4, 5, base=200)
    parent = Request("parent", [300 + i for i in range(6)], 50, n=2, ignore_eos=True)
    for r in (running, mid_prefill, parent, waiting):
        sched.add_request(r)
    driver.step()
    assert mid_prefill.status is RequestStatus.RUNNING and 0 < mid_prefill.num_computed_tokens < 60
    assert waiting.status is RequestStatus.WAITING
    _abort_and_check(sched, driver, "mid-prefill", ["mid-prefill"])
    _abort_and_check(sched, driver, "waiting", ["waiting"])
    assert sched.requests["parent#1"].status is RequestStatus.RUNNING
    _abort_and_check(sched, driver, "parent", ["parent", "parent#1"])
    _abort_and_check(sched, driver, "decoding", ["decoding"])
    assert sched.abort("decoding") == [] and sched.abort("never-seen") == []
    done = req("done", 2, 1, base=400)
    sched.add_request(done)
    driver.run()
    assert done.status is RequestStatus.FINISHED_LENGTH and sched.abort("done") == []
    assert sched.kv_cache.num_free_blocks == 32 and not sched.has_unfinished_requests()


def test_abort_a_preempted_request():
    sched = make_scheduler(num_blocks=8, block_size=4)
    a, b = req("a", 8, 20), req("b", 7, 20, base=100)
    sched.add_request(a)
    sched.add_request(b)
    driver = Driver(sched)
    while b.status is not RequestStatus.PREEMPTED:
        driver.step()
    _abort_and_check(sched, driver, "b", ["b"])
    driver.run()
    assert sched.kv_cache.num_free_blocks == 8


def test_abort_between_schedule_and_update_drops_the_sample():
    sched = make_scheduler()
    r = req("a", 4, 5)
    sched.add_request(r)
    driver = Driver(sched, check=False)
    out = sched.schedule()
    sampled = driver.runner.execute(out)
    sched.abort("a")
    assert sched.update(out, sampled) == [] and r.num_output_tokens == 0
    sched.check_invariants()


def test_engine_finishes_a_request_on_a_stop_string():
    sched = make_scheduler()
    r = req("a", 4, 50)
    sched.add_request(r)
    driver = Driver(sched)
    driver.step()
    assert sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_STOPPED) == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED and not sched.kv_cache.has_blocks(r)
    with pytest.raises(ValueError, match="status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
    out, _ = driver.step()
    assert out.finished_request_ids == ["a"]


def test_stop_conditions_end_requests_and_free_blocks():
    sched = make_scheduler()
    eos = reference_output(Request("x", [5, 6, 7], 1))[0]  # the fake model's first token here
    stopper = Request("eos", [5, 6, 7], 10, eos_token_id=eos)
    ignorer = Request("ignore", [5, 6, 7], 3, eos_token_id=eos, ignore_eos=True)
    late = Request("min", [5, 6, 7], 4, eos_token_id=eos, min_tokens=2)
    by_id = Request("stop-id", [5, 6, 7], 10, stop_token_ids={eos})
    for r in (stopper, ignorer, late, by_id):
        sched.add_request(r)
    driver = Driver(sched)
    driver.run()
    assert stopper.output_token_ids == [eos] and by_id.output_token_ids == [eos] and by_id.stop_reason == eos
    assert len(ignorer.output_token_ids) == 3 and ignorer.output_token_ids[0] == eos
    # min_tokens: the EOS at the first position does not stop the request.
    assert late.output_token_ids[0] == eos and late.output_token_ids == reference_output(late)
    assert len(late.output_token_ids) >= 2
    assert driver.finish_reasons["eos"] == driver.finish_reasons["stop-id"] == "stop"
    assert driver.finish_reasons["ignore"] == "length"
    assert sched.schedule().finished_request_ids and sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_update_rejects_a_wrong_number_of_samples():
    sched = make_scheduler()
    sched.add_request(req("a", 4, 5))
    out = sched.schedule()
    with pytest.raises(ValueError, match="must hold 1 token"):
        sched.update(out, {"a": [1, 2]})
    with pytest.raises(ValueError, match="must hold 1 token"):
        sched.update(out, {})


def test_stats_report_the_engine_fields():
    sched = make_scheduler(num_blocks=10, block_size=4)
    sched.add_request(req("a", 6, 5))
    sched.add_request(req("b", 6, 5))
    Driver(sched).step()
    s = sched.stats()
    # b reuses a's first block in the same step: 3 blocks, each table's tail half empty.
    assert (s.kv_total_blocks, s.kv_free_blocks, s.num_running, s.num_waiting) == (10, 7, 2, 0)
    assert s.kv_usage == pytest.approx(0.3) and s.kv_waste == pytest.approx(4 / 12)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions) == (12, 4, 0)


def test_waste_stays_under_4_percent_at_steady_load():
    import random

    rng = random.Random(0)
    sched = make_scheduler(num_blocks=1200, block_size=16, max_num_batched_tokens=512, max_num_seqs=32)
    for i in range(120):
        prompt = [rng.randrange(30_000) for _ in range(rng.randint(50, 600))]
        sched.add_request(Request(f"r{i}", prompt, rng.randint(100, 500), ignore_eos=True))
    driver = Driver(sched, check=False)
    waste = []
    while sched.has_unfinished_requests():
        driver.step()
        if len(sched.waiting):
            waste.append(sched.stats().kv_waste)
    assert len(waste) > 500 and max(waste) < 0.04
