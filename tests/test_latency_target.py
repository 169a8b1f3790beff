"""The engine under a latency target (--itl-target-ms): whatever budget each step gets,
outputs are those of the fixed budget; the budget learns from measured step times."""
from __future__ import annotations

import json

import pytest

from engine_utils import assert_all_blocks_free, busy_batch, make_llm
from pagedserve.engine_config import EngineConfig
from pagedserve.core.step_budget import AUTO_ITL_RATIO, LatencyTarget, StepTimeModel
from pagedserve.engine.step_timing import calibration_entry, prior_step_time_model, step_time_model
from pagedserve.model.loader import load_model


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def _outputs(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("itl_ms", [1.0, 150.0, None])
def test_outputs_are_the_fixed_budgets_whatever_the_target(loaded, itl_ms):
    """1 ms: every step gets the minimum chunk beside its decodes; 150 ms: chunks vary
    with the decode load; None: the automatic target, the default. Greedy and seeded
    rows, prefix hits, the busy batch of 32."""
    prompts, params = busy_batch(loaded.tokenizer)
    fixed = make_llm(loaded, max_num_batched_tokens=256)
    assert fixed.engine.scheduler.step_budget is None
    targeted = make_llm(loaded, itl_target_ms=itl_ms)
    assert targeted.engine.scheduler.step_budget is not None
    assert targeted.engine.scheduler.config.max_num_batched_tokens == 2048
    assert _outputs(targeted, prompts, params) == _outputs(fixed, prompts, params)
    assert targeted.engine.scheduler.step_budget.correction.num_observed > 0
    assert_all_blocks_free(targeted)


def test_a_wave_with_nothing_running_is_prefilled_in_one_step(loaded):
    llm = make_llm(loaded, itl_target_ms=50.0)
    engine = llm.engine
    prompts, params = busy_batch(loaded.tokenizer)
    wave = [i for i in range(12) if i % 4]  # no shared prefix: every prompt token is computed
    for i in wave:
        engine.add_request(prompts[i], params[i])
    first = engine.scheduler.schedule()
    assert [r.num_new_tokens for r in first.scheduled] == [len(prompts[i]) for i in wave]


def test_target_flags_are_validated_by_name():
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(itl_target_ms=0)
    with pytest.raises(ValueError, match="ttft_target_ms"):
        EngineConfig(ttft_target_ms=float("nan"))
    assert EngineConfig(ttft_target_ms=500).resolve("cpu").scheduling.latency_target.ttft_s == 0.5


def test_the_automatic_target_is_the_default_only_where_nothing_fixes_the_budget():
    def scheduling(**options):
        return EngineConfig(**options).resolve("cpu").scheduling

    assert scheduling().latency_target == LatencyTarget(itl_ratio=AUTO_ITL_RATIO)
    assert scheduling().scheduler_config(8192).max_num_batched_tokens == 2048
    assert scheduling(itl_target_ms=80).latency_target == LatencyTarget(itl_s=0.08)
    assert scheduling(max_num_batched_tokens=256).latency_target is None
    assert scheduling(policy="continuous").latency_target is None
    assert scheduling(enable_chunked_prefill=False).latency_target is None


def test_a_target_needs_chunked_prefill(loaded):
    with pytest.raises(ValueError, match="chunked prefill"):
        make_llm(loaded, itl_target_ms=100.0, policy="continuous")


def test_the_calibrated_step_time_model_is_used_only_for_its_model(loaded, tmp_path):
    config = loaded.config
    calibrated = StepTimeModel(0.01, 0.002, 0.001, 1e-5, 1e-6)
    path = tmp_path / "cpu-local.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "step_time_model": calibration_entry(calibrated, config)}))
    assert step_time_model(config, path) == (calibrated, f"calibrated ({path})")
    other = json.loads(path.read_text())
    other["step_time_model"]["model_shape"][0] += 1
    path.write_text(json.dumps(other))
    model, source = step_time_model(config, path)
    assert model == prior_step_time_model(config) and "prior" in source
    assert step_time_model(config, tmp_path / "missing.json")[0] == prior_step_time_model(config)
