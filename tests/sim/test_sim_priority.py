"""Priority classes in the simulator (the real scheduler's priority queue and preemption) and
the doctor's rule that recommends --scheduling-policy priority for them."""
from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.sim.cost_model import CostModel
from pagedserve.sim.doctor import ServeConfig, diagnose_priorities
from pagedserve.sim.hardware import get_hardware
from pagedserve.sim.models import MODELS
from pagedserve.sim.simulator import SimConfig, simulate
from pagedserve.workload.datasets import BenchRequest, jsonl_dataset, random_dataset, with_priority_classes
from pagedserve.workload.serving_stats import CLASS_TTFT

COST = CostModel(MODELS["llama-3.1-8b"], get_hardware("h100-sxm5"), "bf16")


def full_batch_then_urgent() -> list[BenchRequest]:
    """Four long low-priority streams fill every seat; an urgent request arrives once they run."""
    low = random_dataset(4, 64, 400, seed=1)
    for r in low:
        r.priority, r.arrival_time = 1, 0.0
    urgent = BenchRequest(random_dataset(1, 64, 4, seed=2)[0].prompt_token_ids, 4, arrival_time=0.5, priority=0)
    return [*low, urgent]


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_an_urgent_request_preempts_a_full_batch_only_under_priority(scheduling_policy):
    requests = full_batch_then_urgent()
    config = SimConfig(num_blocks=1000, max_num_seqs=4, scheduling_policy=scheduling_policy)
    res = simulate(requests, COST, config)
    urgent, low = res.records[-1], res.records[:-1]
    step = max(st.duration for st in res.steps)
    if scheduling_policy == "priority":
        assert urgent.ttft <= 3 * step  # admitted at the next step boundary, a low stream preempted
        assert res.num_preemptions == 1 and urgent.token_times[-1] < min(r.token_times[-1] for r in low)
    else:
        assert urgent.ttft > min(r.e2el for r in low) - urgent.send_time - step  # waited for a seat
        assert res.num_preemptions == 0
    assert [len(r.token_times) for r in res.records] == [r.output_len for r in requests]
    res.scheduler.check_invariants()
    assert res.scheduler.kv_cache.num_free_blocks == res.scheduler.kv_cache.num_blocks
    summary = res.summary()
    assert summary[CLASS_TTFT + "0"] == pytest.approx(urgent.ttft * 1e3)


def test_workloads_carry_priorities(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 8, "output_len": 2, "priority": 3}\n{"prompt_len": 8, "output_len": 2}\n')
    assert [r.priority for r in jsonl_dataset(path)] == [3, 0]
    path.write_text('{"prompt_len": 8, "output_len": 2, "priority": "high"}\n')
    with pytest.raises(ValueError, match="priority must be an integer"):
        jsonl_dataset(path)
    every = with_priority_classes(random_dataset(6, 8, 2), 3)
    assert [r.priority for r in every] == [1, 1, 0, 1, 1, 0]


# Llama 3.1 8B on an H100 with 16 seats: 256 requests at once queue for seats, and FCFS makes
# the urgent eighth wait behind the others.
BUSY = dict(model="llama-3.1-8b", hardware="h100-sxm5", max_model_len=4096, max_num_seqs=16,
            max_num_batched_tokens=512, ttft_target_ms=500)


def busy_workload() -> list[BenchRequest]:
    return with_priority_classes(random_dataset(128, 256, 128, 0.25, seed=0), 8)


def test_doctor_recommends_priority_when_the_urgent_class_misses_its_ttft_target():
    [f] = diagnose_priorities(ServeConfig(**BUSY), busy_workload())
    assert f.id == "priority-classes-served-fcfs" and f.change == {"scheduling_policy": "priority"}
    before, after = f.impact["before"], f.impact["after"]
    assert before["p99_ttft_high_ms"] > 500 and after["p99_ttft_high_ms"] < before["p99_ttft_high_ms"] / 2
    assert "--scheduling-policy priority" in f.fix and "classes [0, 1]" in f.message


@pytest.mark.parametrize("case", ["already-priority", "one-class", "no-target", "target-met"])
def test_doctor_says_nothing_when_priority_would_not_help(case):
    cfg, requests = dict(BUSY), busy_workload()
    if case == "already-priority":
        cfg["scheduling_policy"] = "priority"
    elif case == "one-class":
        requests = random_dataset(128, 256, 128, 0.25, seed=0)
    elif case == "no-target":
        cfg["ttft_target_ms"] = None
    else:
        cfg["ttft_target_ms"] = 1e7
    assert diagnose_priorities(ServeConfig(**cfg), requests) == []


def test_doctor_cli_reads_the_classes_from_the_workload(capsys):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in BUSY.items()]
    assert main(["doctor", *flags, "--dataset-name", "random", "--num-prompts", "128", "--input-len", "256",
                 "--output-len", "128", "--range-ratio", "0.25", "--priority-every", "8", "--json"]) == 0
    found = {f["id"]: f for f in json.loads(capsys.readouterr().out)}
    assert found["priority-classes-served-fcfs"]["change"] == {"scheduling_policy": "priority"}
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        ServeConfig(scheduling_policy="lifo")
