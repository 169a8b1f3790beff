"""doctor --simulate recommends only what its own simulation supports, on workloads that
exercise each fix; doctor --tune finds a configuration at least as good as the default
that meets every constraint, the same one for the same seed."""
import json
import math

import pytest

from pagedserve.workload.datasets import mixed_dataset, random_dataset
from pagedserve.entrypoints.cli import main
from pagedserve.sim.doctor import Objective, ServeConfig, diagnose, quantify, simulate_config
from pagedserve.sim.tune import engine_options, serve_flags, tune, vllm_flags

# The issue's example: a 70B FP8 on one H100 (an 18k-token pool), chunked prefill off.
ISSUE = ServeConfig(model="llama-3.3-70b", hardware="h100-sxm5", dtype="fp8", enable_chunked_prefill=False)
# An 8B with the other rules firing: coarse blocks, a stalling budget, an idle third of the
# memory; and one with prefix caching off.
EIGHT_B = ServeConfig(model="llama-3.1-8b", hardware="h100-sxm5", max_model_len=8192, max_num_seqs=64,
                      max_num_batched_tokens=16384, block_size=64, gpu_memory_utilization=0.6)
NO_PREFIX = ServeConfig(model="llama-3.1-8b", hardware="h100-sxm5", max_model_len=8192, max_num_seqs=32,
                        enable_prefix_caching=False)
THROUGHPUT = Objective()


@pytest.fixture(scope="module")
def simulated():
    return {name: quantify(cfg, diagnose(cfg), objective=THROUGHPUT) for name, cfg in
            (("issue", ISSUE), ("8b", EIGHT_B), ("no-prefix", NO_PREFIX))}


def _simulated(findings):
    return [f for f in findings if f.impact is not None]


def test_every_rule_is_simulated(simulated):
    ids = {f.id for fs in simulated.values() for f in _simulated(fs)}
    assert ids >= {"max-model-len-exceeds-pool", "kv-pool-vs-max-num-seqs", "budget-below-longest-prompt",
                   "chunk-stalls-decodes", "block-size-coarse", "prefix-caching-off", "memory-utilization-low"}


def test_no_recommended_fix_is_worse_than_doing_nothing(simulated):
    for findings in simulated.values():
        for f in _simulated(findings):
            before, after = f.impact["before"], f.impact["after"]
            if f.unmodelled:  # kept for a risk the simulator cannot see, with its cost stated
                assert "in simulation" in f.fix or THROUGHPUT.key(after) > THROUGHPUT.key(before), f.id
            elif f.change:
                assert THROUGHPUT.key(after) > THROUGHPUT.key(before), f.id
                assert f.impact["change"] == f.change
            else:  # withdrawn: the fix says so and gives the numbers
                assert f.fix.startswith("not recommended") and "tok/s" in f.fix, f.id


def test_each_workload_exercises_its_parameter(simulated):
    for findings in simulated.values():
        for f in _simulated(findings):
            rule = next(t for t in f.impact["tried"] if t["change"] == f.impact["rule_change"])
            figures = {k: v for k, v in rule.items() if k != "change"}
            assert figures != f.impact["before"], f.id


def test_the_issue_examples_no_longer_happen(simulated):
    findings = simulated["issue"]
    by_id = {f.id: f for f in findings}
    # The fix that made throughput 20x worse is replaced by the max_num_seqs that wins.
    seqs = by_id["kv-pool-vs-max-num-seqs"]
    assert 1 < seqs.change["max_num_seqs"] < 256
    assert seqs.impact["after"]["output_throughput"] > seqs.impact["before"]["output_throughput"]
    # max_model_len: the unclamped configuration cannot start; the fix runs, refusing only
    # the prompts longer than the pool.
    mml = by_id["max-model-len-exceeds-pool"]
    assert "vLLM refuses to start" in mml.impact["before"]["error"]
    assert mml.impact["after"]["rejected"] > 0 and mml.impact["after"]["output_throughput"] > 0
    # Ordered by impact: the fix that makes the configuration start comes first.
    assert findings[0].id == "max-model-len-exceeds-pool"
    gains = [THROUGHPUT.gain(f.impact["before"], f.impact["after"]) for f in _simulated(findings)]
    assert gains == sorted(gains, reverse=True)


def test_a_stall_fix_that_costs_throughput_meets_an_itl_objective():
    cfg = ServeConfig(model="llama-3.1-8b", hardware="h100-sxm5", max_model_len=8192, max_num_seqs=64,
                      max_num_batched_tokens=16384, itl_target_ms=25.0)
    objective = Objective(itl_target_ms=25.0)
    (f,) = quantify(cfg, [f for f in diagnose(cfg) if f.id == "chunk-stalls-decodes"], objective=objective)
    assert f.change and objective.violation(f.impact["after"]) < objective.violation(f.impact["before"])


def test_the_doctor_states_the_latency_target_budget():
    def budget(itl_ms):
        (f,) = [f for f in diagnose(ServeConfig(itl_target_ms=itl_ms)) if f.id == "latency-target-budget"]
        return int(f.message.split("gets a budget of ")[1].split(" tokens")[0].replace(",", ""))

    assert budget(20.0) < budget(60.0)


def test_objective_ordering():
    ok = {"output_throughput": 100.0, "p99_itl_ms": 40.0, "p99_ttft_ms": 900.0, "num_preemptions": 0}
    fast_but_late = {**ok, "output_throughput": 200.0, "p99_itl_ms": 80.0}
    o = Objective(itl_target_ms=50.0)
    assert o.key(ok) > o.key(fast_but_late) > o.key({"error": "x"})
    assert Objective().key(fast_but_late) > Objective().key(ok)
    itl = Objective("itl", min_throughput=150.0)
    assert itl.key(fast_but_late) > itl.key(ok)
    assert o.gain({"error": "x"}, ok) == math.inf


# A workload where decodes share steps with long prompts, under a client concurrency.
WORKLOAD = mixed_dataset(32, 256, 4096, 6, 64, 0.25, seed=5)
BASE = ServeConfig(model="llama-3.1-8b", hardware="h100-sxm5", max_model_len=8192)


@pytest.mark.parametrize("objective", [Objective(itl_target_ms=12.0), Objective("itl", min_throughput=1200.0)],
                         ids=["throughput@itl", "itl@floor"])
def test_tune_beats_the_default_and_meets_the_constraints(objective):
    result = tune(BASE, WORKLOAD, objective, concurrency=16, max_evals=16)
    best, default = result.best.figures, result.default.figures
    assert objective.key(best) >= objective.key(default)
    assert objective.violation(best) == 0 and result.meets_constraints
    assert "nearest miss" not in result.explain()
    assert result.num_evals <= 16
    # The printed figures are the configuration's own simulation.
    assert simulate_config(result.best.config, WORKLOAD, 16) == best
    assert all(objective.key(t.figures) <= objective.key(best) for t in result.runners_up)


def test_an_unreachable_constraint_is_said_and_the_nearest_miss_returned():
    objective = Objective(itl_target_ms=0.01)  # no configuration's p99 ITL is 10 us
    result = tune(BASE, WORKLOAD, objective, concurrency=16, max_evals=8)
    assert not result.meets_constraints and result.to_dict()["best_meets_constraints"] is False
    assert "no simulated configuration meets the constraints" in result.explain()
    assert all(objective.violation(t.figures) >= objective.violation(result.best.figures) for t in result.runners_up)


def test_tune_is_deterministic_and_prints_flags(capsys):
    args = ["doctor", "--tune", "--model", "llama-3.1-8b", "--max-model-len", "8192", "--dataset-name", "mixed",
            "--num-prompts", "24", "--long-input-len", "4096", "--long-every", "6", "--output-len", "32",
            "--concurrency", "16", "--itl-target-ms", "12", "--max-evals", "10", "--seed", "3", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first
    best = first["best"]
    assert best["serve_flags"].startswith("--max-num-seqs") and "--max-num-seqs" in best["vllm_flags"]
    assert first["num_evals"] <= 10


def test_flags_of_a_latency_target_configuration():
    cfg = ServeConfig(model="llama-3.1-8b", max_model_len=8192, budget_by_target=True, itl_target_ms=20.0)
    assert "--itl-target-ms 20" in serve_flags(cfg) and "--max-num-batched-tokens" not in serve_flags(cfg)
    # vLLM (and the engine until it takes the target) gets the budget the target picks.
    budget = engine_options(cfg)["max_num_batched_tokens"]
    assert f"--max-num-batched-tokens {budget}" in vllm_flags(cfg)
    assert budget < engine_options(ServeConfig(**{**cfg.__dict__, "itl_target_ms": 80.0}))["max_num_batched_tokens"]


@pytest.mark.parametrize("num_requests,max_evals", [(4, 4), pytest.param(8, 12, marks=pytest.mark.slow)],
                         ids=["small", "full"])
def test_tuned_and_default_configurations_run_on_the_real_engine(num_requests, max_evals):
    from pagedserve.engine.llm import LLM
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.sim.twin import TWIN_MODEL, TWIN_VOCAB

    requests = random_dataset(num_requests, 64, 12, 0.5, vocab_size=TWIN_VOCAB, seed=0)
    base = ServeConfig(model=TWIN_MODEL, hardware="l40s", max_model_len=2048)
    result = tune(base, requests, Objective(itl_target_ms=20.0), max_evals=max_evals)
    produced = {}
    for name, cfg in (("default", result.default.config), ("tuned", result.best.config)):
        # A small pool: what the tuner chose (seats, budget, block size, caching) is what runs;
        # a pool sized by free RAM would cost seconds of page faults per engine.
        llm = LLM(**{**engine_options(cfg), "kv_cache_memory": "64MiB"})
        assert llm.engine.scheduler.config.max_num_seqs == cfg.max_num_seqs
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in requests]
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        produced[name] = [len(o.outputs[0].token_ids) for o in outputs]
    assert produced["tuned"] == produced["default"] == [r.output_len for r in requests]
