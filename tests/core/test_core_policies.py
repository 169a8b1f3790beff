"""The scheduler-study policies: what each one admits and what it computes."""
from __future__ import annotations

from fake_runner import Driver, make_scheduler, reference_output
from pagedserve.core import Request


def req(rid: str, prompt_len: int, max_tokens: int, base: int = 0, **kw) -> Request:
    return Request(rid, [base + i for i in range(prompt_len)], max_tokens, ignore_eos=True, **kw)


def test_static_pads_finished_rows_and_admits_nothing_until_the_batch_ends():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, policy="static")
    batch = [req("a", 3, 2), req("b", 3, 5, base=10), req("c", 3, 9, base=20)]
    for r in batch:
        sched.add_request(r)
    driver = Driver(sched)
    driver.step()
    sched.add_request(req("late", 3, 2, base=30))
    steps = []
    while not batch[2].is_finished:
        out, _ = driver.step()
        steps.append(out)
    # The batch keeps all three rows to the end; finished ones compute discarded padding.
    assert all(sorted(r.request_id for r in out.scheduled) == ["a", "b", "c"] for out in steps)
    padding = [r.request_id for out in steps for r in out.scheduled if r.is_padding]
    assert padding.count("a") == 9 - 2 and padding.count("b") == 9 - 5
    assert all(r.num_samples == 0 for out in steps for r in out.scheduled if r.is_padding)
    assert all(out.num_scheduled_tokens == 3 for out in steps)
    assert all(not out.finished_request_ids for out in steps)
    assert {rid: len(toks) for rid, toks in driver.outputs.items()} == {"a": 2, "b": 5, "c": 9}
    assert all(driver.outputs[r.request_id] == reference_output(r) for r in batch)
    out, _ = driver.step()  # the batch is over: its rows are released, the next one forms
    assert sorted(out.finished_request_ids) == ["a", "b", "c"]
    assert [r.request_id for r in out.scheduled] == ["late"]
    driver.run()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_static_padding_gives_up_its_blocks_before_anyone_is_preempted():
    sched = make_scheduler(num_blocks=10, block_size=4, policy="static")
    short, long = req("short", 4, 2), req("long", 4, 30, base=50)
    sched.add_request(short)
    sched.add_request(long)
    driver = Driver(sched)
    released_early = False
    while not long.is_finished:
        out, _ = driver.step()
        released_early |= "short" in out.finished_request_ids
    assert released_early and long.num_preemptions == 0
    assert driver.outputs["long"] == reference_output(long)


def test_naive_runs_one_request_at_a_time_start_to_finish():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, policy="naive")
    requests = [req(f"r{i}", 4, 3 + i, base=10 * i) for i in range(3)] + [Request("fan", [7, 8, 9], 3, n=2)]
    for r in requests:
        sched.add_request(r)
    driver = Driver(sched)
    driver.run()
    families = [{row.request_id.split("#")[0] for row in out.scheduled} for out in driver.history if out.scheduled]
    assert all(len(f) == 1 for f in families)
    order = [f.pop() for f in families]
    assert [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k] == ["r0", "r1", "r2", "fan"]
    # Each request computes its prompt once and then one token per step.
    assert len(driver.history) == sum(r.max_tokens for r in requests)


def test_continuous_prefills_whole_prompts_and_chunked_splits_them():
    for policy, expected in [("continuous", [100]), ("chunked", [32, 32, 32, 4])]:
        sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32, policy=policy)
        sched.add_request(req("p", 100, 2))
        driver = Driver(sched)
        chunks = [driver.step()[0].scheduled[0].num_new_tokens for _ in expected]
        assert chunks == expected, policy


def test_chunked_prefill_can_be_switched_off_by_its_flag():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    sched.add_request(req("p", 100, 2))
    assert Driver(sched).step()[0].scheduled[0].num_new_tokens == 100
