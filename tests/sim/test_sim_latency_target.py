"""A latency target drives the real scheduler in the simulator: on W2-, W3-
and W4-shaped workloads (docs/benchmarks.md) (scaled down) it holds p99 ITL near its target where a fixed
256-token budget misses it (W2), and under load it keeps the fixed budget's throughput
with a tail no worse (W3, W4)."""
import pytest

from pagedserve.workload.datasets import mixed_dataset, random_dataset
from pagedserve.sim.cost_model import CostModel
from pagedserve.sim.hardware import Hardware, MeasuredRates
from pagedserve.sim.models import MODELS
from pagedserve.sim.simulator import SimConfig, simulate

# Rates of the order `sim calibrate` measures on the project's 2-core machine for SmolLM2
# (fp32): bandwidth-bound 1-row GEMMs, ~90 GFLOP/s at a 256-token step.
RATES = MeasuredRates(linear=((1, 5.5e9), (4, 13e9), (32, 45e9), (256, 90e9), (1024, 100e9)),
                      head=((1, 6e9), (4, 15e9), (32, 50e9)), attention_flops=20e9, kv_bandwidth=5e9,
                      attention_call_s=1e-4, overhead_per_token_s=2e-5, min_prefill_len=16)
CPU = Hardware("cpu-local", 24 << 30, 5e9, {"fp32": 100e9}, 5e9, 5e-3, 1.0, 1.0, measured=RATES)
COST = CostModel(MODELS["smollm2-135m"], CPU, "fp32")

WORKLOADS = {
    # 16 clients whose 128-token prompts arrive in waves: one step per wave beats 8 chunks.
    "W2": (random_dataset(48, 128, 64, seed=1), 16, 300.0),
    # 64 clients, 256-token prompts: the target holds the step near it.
    "W3": (random_dataset(96, 256, 48, seed=2), 64, 800.0),
    # every 8th prompt 2,000 tokens: long prompts chunked around the running decodes.
    "W4": (mixed_dataset(48, 64, 2000, 8, 48, 0.0, seed=3), 32, 800.0),
}


def _run(workload: str, **options):
    requests, concurrency, _ = WORKLOADS[workload]
    return simulate(requests, COST, SimConfig(num_blocks=20_000, max_num_seqs=64, concurrency=concurrency,
                                              **options))


def _check_clean(run) -> None:
    sched = run.scheduler
    sched.check_invariants()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    # The affine model fitted from the cost model is within 1.5x of the cost model's own
    # steps; the running correction absorbs the rest.
    correction = sched.step_budget.correction
    assert 1 / 1.5 <= correction.decode_scale <= 1.5 and 1 / 1.5 <= correction.prefill_scale <= 1.5


def test_target_meets_p99_itl_where_the_fixed_budget_misses():
    target_ms = WORKLOADS["W2"][2]
    fixed = _run("W2", max_num_batched_tokens=256).summary()
    targeted_run = _run("W2", max_num_batched_tokens=2048, itl_target_ms=target_ms)
    targeted = targeted_run.summary()
    assert fixed["p99_itl_ms"] > target_ms * 1.1
    assert targeted["p99_itl_ms"] <= target_ms * 1.05
    assert targeted["output_throughput"] >= 0.95 * fixed["output_throughput"]
    _check_clean(targeted_run)


@pytest.mark.parametrize("workload", ["W3", "W4"])
def test_under_load_the_target_keeps_the_fixed_budgets_throughput_with_no_worse_tail(workload):
    # Here the batch the load asks for needs more prompt tokens per step than the target
    # leaves: the supply floor keeps it supplied (a target alone drained it, at 0.65-0.72x
    # the throughput on the real engine), so the steps are the fixed budget's.
    target_ms = WORKLOADS[workload][2]
    fixed = _run(workload, max_num_batched_tokens=256).summary()
    targeted_run = _run(workload, max_num_batched_tokens=2048, itl_target_ms=target_ms)
    targeted = targeted_run.summary()
    assert targeted["output_throughput"] >= 0.95 * fixed["output_throughput"]
    assert targeted["p99_itl_ms"] <= 1.05 * fixed["p99_itl_ms"]
    assert targeted_run.scheduler.step_budget.supply.num_observed > 0
    _check_clean(targeted_run)


def test_a_wave_with_nothing_running_goes_in_one_step():
    res = _run("W2", max_num_batched_tokens=2048, itl_target_ms=300.0)
    assert res.steps[0].prefill_tokens == 16 * 128 and res.steps[0].decode_rows == 0


def test_a_target_needs_the_chunked_policy():
    with pytest.raises(ValueError, match="chunked prefill"):
        _run("W2", policy="continuous", max_num_batched_tokens=2048, itl_target_ms=300.0)
