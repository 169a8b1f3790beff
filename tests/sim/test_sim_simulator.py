"""The simulator drives the real scheduler: it must finish every request exactly, leak no
blocks, respect the token budget, and follow the arrival / concurrency rules."""
import math

import pytest

from pagedserve.workload.datasets import BenchRequest, mixed_dataset
from pagedserve.sim.cost_model import CostModel
from pagedserve.sim.hardware import get_hardware
from pagedserve.sim.models import MODELS
from pagedserve.sim.simulator import SimConfig, simulate

COST = CostModel(MODELS["llama-3.1-8b"], get_hardware("h100-sxm5"), "bf16")
WORKLOAD = mixed_dataset(48, 64, 1024, 8, 24, 0.5, seed=3)


@pytest.mark.parametrize("policy", ["chunked", "continuous", "static", "naive"])
def test_every_request_finishes_and_no_block_leaks(policy):
    # A pool of 160 blocks (2,560 tokens) forces preemption under 48 concurrent requests.
    budget = 256 if policy == "chunked" else 2048
    res = simulate(WORKLOAD, COST, SimConfig(policy=policy, num_blocks=160, max_num_seqs=32,
                                             max_num_batched_tokens=budget))
    assert [len(r.token_times) for r in res.records] == [r.output_len for r in WORKLOAD]
    sched = res.scheduler
    sched.check_invariants()
    assert not sched.has_unfinished_requests() and not sched.requests
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    for st in res.steps:
        assert st.prefill_tokens + st.decode_rows + st.padding_rows <= budget or st.decode_rows == 0
    if policy == "chunked":
        assert res.num_preemptions > 0
        assert all(st.prefill_tokens + st.decode_rows <= budget for st in res.steps)
    if policy == "naive":
        assert all(st.decode_rows + (st.prefill_tokens > 0) <= 1 for st in res.steps)


def test_time_advances_by_the_cost_model():
    res = simulate(WORKLOAD[:4], COST, SimConfig(policy="chunked", num_blocks=1000))
    assert res.duration == pytest.approx(sum(st.duration for st in res.steps))
    for a, b in zip(res.steps, res.steps[1:]):
        assert b.start == pytest.approx(a.start + a.duration)
    assert all(r.token_times == sorted(r.token_times) and r.ttft > 0 for r in res.records)


def test_concurrency_caps_requests_in_flight():
    reqs = [BenchRequest([11] * 32, 8) for _ in range(6)]
    res = simulate(reqs, COST, SimConfig(policy="continuous", num_blocks=1000, concurrency=2,
                                         max_num_batched_tokens=2048))
    spans = sorted((r.send_time, r.token_times[-1]) for r in res.records)
    for t, _ in spans:
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    # the 3rd request is sent the moment the first one finishes
    assert spans[2][0] == pytest.approx(min(e for _, e in spans[:2]))


def test_poisson_arrivals_are_seeded_and_respected():
    reqs = [BenchRequest([11] * 16, 4) for _ in range(20)]
    a = simulate(reqs, COST, SimConfig(num_blocks=500, request_rate=5.0, seed=1))
    b = simulate(reqs, COST, SimConfig(num_blocks=500, request_rate=5.0, seed=1))
    sends = [r.send_time for r in a.records]
    assert sends == [r.send_time for r in b.records] and sends == sorted(sends)
    assert sends[-1] == pytest.approx(20 / 5.0, rel=0.6)
    with pytest.raises(ValueError):
        SimConfig(request_rate=0.0)
    assert math.isinf(SimConfig().request_rate)


def test_static_waits_for_the_slowest_member():
    reqs = [BenchRequest([11] * 16, n) for n in (50, 120, 240, 1024)] + [BenchRequest([12] * 16, 5)]
    res = simulate(reqs, COST, SimConfig(policy="static", num_blocks=1000, max_num_seqs=4,
                                         max_num_batched_tokens=2048))
    last_of_batch = max(r.token_times[-1] for r in res.records[:4])
    assert res.records[4].token_times[0] > last_of_batch
    assert max(st.padding_rows for st in res.steps) == 3  # three of four rows idle, as the seed says


def test_contiguous_layout_admits_by_pages_and_gives_them_back():
    from pagedserve.core.contiguous_kv import plan_contiguous

    m = MODELS["smollm2-135m"]
    reqs = [BenchRequest(list(range(40 + i)), 30) for i in range(24)]
    cost = CostModel(m, get_hardware("l40s"), "fp32")
    stream = m.num_kv_heads * m.head_dim * 4
    memory = 160 * 16 * stream * 2 * m.num_layers  # as much as 160 paged blocks
    layout = plan_contiguous(memory, 512, 32, 16, stream, 2 * m.num_layers)
    paged = simulate(reqs, cost, SimConfig(num_blocks=160, max_num_seqs=32, max_model_len=512,
                                           enable_prefix_caching=False))
    res = simulate(reqs, cost, SimConfig(num_blocks=160, max_num_seqs=32, max_model_len=512, contiguous=layout))
    assert all(len(r.token_times) == 30 for r in res.records)
    kv = res.scheduler.kv_cache
    assert kv.committed_pages == 0 and 0 < kv.peak_committed_pages <= layout.budget_pages
    assert res.summary()["kv_waste"] < paged.summary()["kv_waste"]


def test_a_measured_step_spread_lengthens_the_tail_not_the_run():
    from dataclasses import replace

    config = SimConfig(policy="chunked", num_blocks=4000, max_num_seqs=32, concurrency=16, seed=5)
    plain = simulate(WORKLOAD, COST, config)
    # Nine steps in ten at 0.9x their price, one in ten at 1.9x: a mean of 1.
    spread = (0.9,) * 9 + (1.9,)
    noisy_cost = CostModel(MODELS["llama-3.1-8b"], replace(get_hardware("h100-sxm5"), step_spread=spread), "bf16")
    noisy = simulate(WORKLOAD, noisy_cost, config)
    assert simulate(WORKLOAD, noisy_cost, config).summary() == noisy.summary()  # seeded
    factors = {round(n.duration / p.duration, 9) for n, p in zip(noisy.steps, plain.steps)}
    assert factors <= {0.9, 1.9} and len(factors) == 2
    assert noisy.summary()["p99_itl_ms"] > 1.5 * plain.summary()["p99_itl_ms"]
    assert noisy.duration == pytest.approx(plain.duration, rel=0.15)
    # A flat spread is no spread.
    flat = CostModel(MODELS["llama-3.1-8b"], replace(get_hardware("h100-sxm5"), step_spread=(1.0,)), "bf16")
    assert simulate(WORKLOAD, flat, config).summary() == plain.summary()
