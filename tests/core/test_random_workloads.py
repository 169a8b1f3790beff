"""Random workloads on small pools: every invariant holds after every call, nothing
leaks, nothing deadlocks, and every request that ran to its own end produced
exactly the tokens the fake model gives without any cache at all."""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fake_runner import Driver, make_scheduler, reference_output
from pagedserve.core import Request, RequestStatus

SHARED_PREFIXES = [list(range(1000, 1024)), list(range(2000, 2009))]


@st.composite
def configs(draw):
    budget = draw(st.integers(4, 48))
    return dict(
        num_blocks=draw(st.integers(4, 40)),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        enable_prefix_caching=draw(st.booleans()),
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, min(6, budget))),
        policy=draw(st.sampled_from(["chunked", "continuous", "static", "naive"])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
    )


@st.composite
def request_specs(draw, index: int):
    prompt = draw(st.sampled_from([[], *SHARED_PREFIXES])) + draw(st.lists(st.integers(0, 999), max_size=20))
    max_tokens = draw(st.integers(1, 24))
    return dict(
        arrival=draw(st.integers(0, 30)),
        abort_at=draw(st.one_of(st.none(), st.integers(0, 60))),
        stop_string_at=draw(st.one_of(st.none(), st.integers(0, 60))),
        kwargs=dict(
            request_id=f"r{index}",
            prompt_token_ids=prompt or [index],
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(2, max_tokens))),
            n=draw(st.sampled_from([1, 1, 1, 2, 3])),
            priority=draw(st.integers(0, 2)),
            eos_token_id=7,
            stop_token_ids=draw(st.sampled_from([(), (11, 12)])),
            ignore_eos=draw(st.booleans()),
            cache_salt=draw(st.sampled_from([None, None, "tenant"])),
        ),
    )


@st.composite
def workloads(draw):
    config = draw(configs())
    count = draw(st.integers(1, 10))
    return config, [draw(request_specs(i)) for i in range(count)]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant_and_never_leak(workload):
    config, specs = workload
    sched = make_scheduler(**config)
    driver = Driver(sched)
    accepted: dict[str, dict] = {}
    ended_by_engine: set[str] = set()
    last_arrival = max(s["arrival"] for s in specs)
    step = 0
    while step <= last_arrival or sched.has_unfinished_requests():
        for spec in specs:
            if spec["arrival"] == step:
                request = Request(**spec["kwargs"], arrival_time=float(step))
                try:
                    sched.add_request(request)
                except ValueError:
                    needed = -(-(request.num_prompt_tokens + request.max_tokens) // config["block_size"])
                    assert needed > config["num_blocks"] or request.n > config["max_num_seqs"]
                    continue
                accepted[request.request_id] = spec | {"request": request}
        for rid, spec in accepted.items():
            if spec["abort_at"] == step:
                ended_by_engine.update(r.request_id for r in sched.abort(rid))
            elif spec["stop_string_at"] == step:
                ended = sched.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                ended_by_engine.update(r.request_id for r in ended)
        sched.check_invariants()
        if sched.has_unfinished_requests():
            driver.step()
        step += 1
        assert step < 3000, "no progress: deadlock or livelock"

    driver.step()  # hand the last releases to the runner
    # Shown by --hypothesis-show-statistics: which mechanisms the examples exercised.
    history = driver.history
    event(f"policy={config['policy']}")
    for name, seen in [
        ("preemption", any(o.preempted_request_ids for o in history)),
        ("copy-on-write", any(o.block_copies for o in history)),
        ("padding", any(r.is_padding for o in history for r in o.scheduled)),
        ("prefix hit", sched.kv_cache.prefix_cache_hits > 0),
        ("over-budget prompt step", any(o.num_scheduled_tokens > config["max_num_batched_tokens"] for o in history)),
    ]:
        if seen:
            event(name)
    assert sched.kv_cache.num_free_blocks == config["num_blocks"]
    assert not (sched.requests or sched.running or sched.padding or len(sched.waiting))
    sched.check_invariants()
    assert not driver.runner.tables, "the runner was not told to drop every request"
    for rid, spec in accepted.items():
        parent = spec["request"]
        family = [parent] + [r for r in driver.seen.values() if r.parent_id == rid]
        assert len(family) in (1, parent.n)
        for member in family:
            assert member.is_finished
            assert driver.outputs.get(member.request_id, []) == member.output_token_ids
            if member.request_id not in ended_by_engine:
                assert member.output_token_ids == reference_output(parent, index=member.index)
