"""The latency-target budget rule (core/step_budget.py) as a pure function."""
import math

import pytest

from pagedserve.core.step_budget import (
    LatencyTarget,
    StepBudget,
    StepTimeCorrection,
    StepTimeModel,
    choose_budget,
    max_prefill_tokens,
    predict_step,
    prefill_pairs,
    step_parts,
)

MODEL = StepTimeModel(fixed_s=0.04, per_token_s=0.002, per_sample_s=0.001, per_context_token_s=1e-5,
                      per_pair_s=3e-6)


def test_prediction_adds_what_the_step_carries():
    # 3 decodes at contexts 10, 20, 30 and a 100-token chunk after 50 tokens, 4 samples.
    rows = [(1, 10), (1, 20), (1, 30), (100, 50)]
    expected = 0.04 + 0.002 * 103 + 0.001 * 4 + 1e-5 * 63 + 3e-6 * prefill_pairs(100, 50)
    assert predict_step(MODEL, rows, 4) == pytest.approx(expected)
    assert prefill_pairs(100, 50) == 100 * 50 + 5050


@pytest.mark.parametrize("context", [0, 100, 2000])
def test_max_prefill_tokens_is_the_largest_that_fits(context):
    for seconds in (0.05, 0.3, 1.0, 5.0):
        n = max_prefill_tokens(MODEL, seconds, 0.04, context)
        cost = lambda k: 0.04 + MODEL.per_token_s * k + MODEL.per_pair_s * prefill_pairs(k, context)  # noqa: E731
        assert cost(n) <= seconds + 1e-12
        assert cost(n + 1) > seconds


def test_budget_is_monotone_in_the_target_and_never_above_the_cap():
    budgets = [choose_budget(MODEL, LatencyTarget(itl_s=t / 1000), 2048, 16, 16 * 300) for t in range(50, 5000, 50)]
    assert budgets == sorted(budgets)
    assert budgets[0] < budgets[-1] and all(b <= 2048 for b in budgets)
    assert choose_budget(MODEL, LatencyTarget(itl_s=100.0), 2048, 16, 16 * 300) == 2048
    for cap in (1, 17, 300):
        assert choose_budget(MODEL, LatencyTarget(itl_s=10.0), cap, 16, 0) <= cap


def test_a_waiting_prompt_always_advances_a_minimum_chunk():
    # 64 decodes over long contexts already exceed a 50 ms target: the prompt still gets 16.
    target = LatencyTarget(itl_s=0.05, min_chunk=16)
    assert choose_budget(MODEL, target, 2048, 64, 64 * 2000) == 64 + 16


def test_no_decodes_running_uses_the_ttft_target_or_the_cap():
    assert choose_budget(MODEL, LatencyTarget(itl_s=0.1), 2048, 0, 0) == 2048
    n = choose_budget(MODEL, LatencyTarget(itl_s=0.1, ttft_s=1.0), 2048, 0, 0)
    assert n == max_prefill_tokens(MODEL, 1.0, MODEL.fixed_s + MODEL.per_sample_s, 0)
    assert 16 < n < 2048


def test_no_target_is_the_fixed_budget():
    assert choose_budget(MODEL, LatencyTarget(), 256, 10, 1000) == 256


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_the_automatic_target_holds_a_step_within_its_ratio_of_the_decodes_alone(rows):
    context = rows * 300
    decode_only = MODEL.decode_seconds(rows, context) + MODEL.per_sample_s
    for ratio in (1.5, 2.0, 4.0):
        budget = choose_budget(MODEL, LatencyTarget(itl_ratio=ratio), 2048, rows, context)
        prefill = budget - rows
        step = decode_only + MODEL.per_token_s * prefill + MODEL.per_pair_s * prefill_pairs(prefill, 0)
        assert prefill == 16 or step <= ratio * decode_only + 1e-12  # the minimum chunk may overrun
        assert choose_budget(MODEL, LatencyTarget(itl_ratio=ratio), 2048, rows, context, decode_scale=2.0) > budget
    # An absolute target, where given, wins over the ratio; with nothing decoding neither applies.
    assert (choose_budget(MODEL, LatencyTarget(itl_s=0.05, itl_ratio=4.0), 2048, rows, context)
            == choose_budget(MODEL, LatencyTarget(itl_s=0.05), 2048, rows, context))
    assert choose_budget(MODEL, LatencyTarget(itl_ratio=2.0), 2048, 0, 0) == 2048


def test_a_slower_machine_gets_smaller_budgets():
    fast = choose_budget(MODEL, LatencyTarget(itl_s=0.5), 2048, 8, 800)
    slow_prefill = choose_budget(MODEL, LatencyTarget(itl_s=0.5), 2048, 8, 800, prefill_scale=2.0)
    slow_decode = choose_budget(MODEL, LatencyTarget(itl_s=0.5), 2048, 8, 800, decode_scale=2.0)
    assert slow_prefill < fast and slow_decode < fast


def test_correction_follows_the_machine_but_one_stall_cannot_swing_it():
    c = StepTimeCorrection(alpha=0.1, step_bound=2.0, total_bound=4.0)
    c.observe(0.1, 0.0, 100.0)  # a 1000x stall counts as 2x, even as the first observation
    assert c.decode_scale == pytest.approx(2.0) and c.prefill_scale == 1.0
    for _ in range(200):
        c.observe(0.1, 0.0, 0.15)
    assert c.decode_scale == pytest.approx(1.5, rel=1e-3)
    c.observe(0.1, 0.0, 100.0)  # once warmed up, a stall moves it by alpha * (2 - 1) of itself at most
    assert c.decode_scale == pytest.approx(1.5 * 1.1, rel=1e-3)
    for _ in range(500):
        c.observe(0.1, 0.0, 100.0)
    assert c.decode_scale == 4.0  # bounded overall
    c.observe(0.0, 0.0, 1.0)
    c.observe(0.1, 0.0, math.nan)
    assert c.decode_scale == 4.0 and c.num_observed == 702


def test_correction_learns_decode_and_prefill_apart():
    # The machine as measured: decodes 1.1x the model, prefill chunks 1.8x.
    c = StepTimeCorrection()
    for i in range(300):
        decode, prefill = 0.05, (0.05 if i % 3 else 0.0)  # two steps in three carry a chunk
        c.observe(decode, prefill, 1.1 * decode + 1.8 * prefill)
    assert c.decode_scale == pytest.approx(1.1, rel=1e-3) and c.prefill_scale == pytest.approx(1.8, rel=1e-3)
    # A step with a sliver of prefill (under decode_share of it) informs the decode scale.
    c.observe(0.1, 0.005, 0.3)
    assert c.num_decode == 101 and c.decode_scale > 1.1


def test_step_budget_learns_from_observed_steps():
    budget = StepBudget(MODEL, LatencyTarget(itl_s=0.5), 2048)
    before = budget.budget(8, 800)
    for _ in range(100):
        budget.observe([(1, 100)] * 8, 8, 2 * predict_step(MODEL, [(1, 100)] * 8, 8))
    assert budget.correction.decode_scale == pytest.approx(2.0, rel=1e-3)
    assert budget.budget(8, 800) < before
    decode_only = budget.budget(8, 800)
    for _ in range(100):  # prefill chunks twice as slow as the model says, beside 8 decodes
        rows = [(1, 100)] * 8 + [(64, 0)]
        decode, prefill = step_parts(MODEL, rows, 8)
        budget.observe(rows, 8, 2 * decode + 2 * prefill)
    assert budget.correction.prefill_scale == pytest.approx(2.0, rel=1e-3)
    assert budget.budget(8, 800) < decode_only


@pytest.mark.parametrize("bad", [dict(itl_s=0), dict(ttft_s=-1.0), dict(itl_s=math.inf), dict(min_chunk=0),
                                 dict(min_chunk=True), dict(itl_ratio=1.0), dict(itl_ratio=math.nan)])
def test_invalid_targets_name_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        LatencyTarget(**bad)


def test_invalid_models_name_the_field():
    with pytest.raises(ValueError, match="per_token_s"):
        StepTimeModel(0.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="per_pair_s"):
        StepTimeModel(0.0, 1.0, 0.0, 0.0, -1.0)
    with pytest.raises(ValueError, match="cap"):
        StepBudget(MODEL, LatencyTarget(), 0)


def test_supply_floor_replaces_what_the_batch_finishes_up_to_the_fixed_step():
    from pagedserve.core.step_budget import PromptSupply

    supply = PromptSupply(step_tokens=256, margin=1.0)
    assert supply.floor(64, 64) == 192  # nothing finished yet: the fixed budget's share
    assert supply.floor(64, 64, expected=(256, 128)) == 128  # or what the requests in the system say
    supply.observe(256, 128)
    assert supply.floor(16, 16) == 32  # 16 rows x 256 / 128
    assert supply.floor(8, 32) == 64  # supplies the batch the load asks for, not the one running
    assert supply.floor(0, 16) == 0
    assert supply.floor(200, 200) == 56  # 400 wanted, but no more than fills the step to 256
    assert supply.floor(300, 300) == 0
    supply.observe(10, 0)  # no output (e.g. cut at once): says nothing about the rate
    assert supply.num_observed == 1
    with pytest.raises(ValueError, match="step_tokens"):
        PromptSupply(step_tokens=0)
    with pytest.raises(ValueError, match="margin"):
        PromptSupply(step_tokens=256, margin=float("nan"))


def test_the_floor_overrides_a_target_the_decodes_leave_no_room_for():
    model = StepTimeModel(0.01, 0.001, 0.0, 0.0, 0.0)
    target = LatencyTarget(itl_s=0.05)
    # 40 decodes already take 0.05 s: the target alone gives the 16-token minimum.
    assert choose_budget(model, target, 2048, 40, 0) == 40 + 16
    assert choose_budget(model, target, 2048, 40, 0, floor=100) == 40 + 100
    # A target with room keeps its own, larger, budget.
    assert choose_budget(model, target, 2048, 4, 0, floor=20) == 4 + 36
    # With nothing running, the floor does not apply (the TTFT target rules).
    assert choose_budget(model, LatencyTarget(itl_s=0.05, ttft_s=0.02), 2048, 0, 0, floor=500) == 16


def test_margin_tracks_the_slow_tenth_of_steps():
    import random

    rng = random.Random(0)
    c = StepTimeCorrection()
    for _ in range(3000):
        c.observe(0.05, 0.0, 0.05 * math.exp(rng.gauss(0.0, 0.1)))  # p90 of the noise: e^0.128 = 1.14
    assert 1.08 <= c.margin <= 1.2
    steady = StepTimeCorrection()
    for _ in range(500):
        steady.observe(0.05, 0.05, 0.1)  # predicted exactly: nothing to allow for
    assert steady.margin == 1.0
    fast = choose_budget(MODEL, LatencyTarget(itl_s=0.5), 2048, 8, 800)
    assert choose_budget(MODEL, LatencyTarget(itl_s=0.5), 2048, 8, 800, margin=1.2) < fast
