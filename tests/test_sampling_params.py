"""SamplingParams: every bound rejected on the wrong side, accepted on the right one."""
from __future__ import annotations

import dataclasses
import math

import pytest

from pagedserve.sampling_params import SamplingParams, child_seed, token_seed

# (keyword arguments, the parameter the error must name)
INVALID = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"temperature": -0.01}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
]

VALID = [
    {"n": 1},
    {"n": 8},
    {"max_tokens": 1},
    {"max_tokens": None},
    {"min_tokens": 0},
    {"max_tokens": 5, "min_tokens": 5},
    {"max_tokens": None, "min_tokens": 10_000},
    {"temperature": 0},
    {"temperature": 2.5},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_p": 1e-9},
    {"top_p": 1.0},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"seed": None},
    {"seed": -3},
    {"seed": 2**70},
    {"repetition_penalty": 1e-3},
    {"repetition_penalty": 10.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"logit_bias": {0: -100.0, 7: 100}},
    {"stop": "\n\n"},
    {"stop": ["a", "b"]},
    {"stop_token_ids": [0, 2]},
    {"include_stop_str_in_output": True, "ignore_eos": True, "skip_special_tokens": False},
    {"logprobs": 0, "prompt_logprobs": 0},
    {"logprobs": 20, "prompt_logprobs": 20},
]


def _case_id(case) -> str:
    kwargs = case[0] if isinstance(case, tuple) else case
    return ",".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize(("kwargs", "param"), INVALID, ids=[_case_id(c) for c in INVALID])
def test_invalid_value_is_rejected_naming_the_parameter(kwargs, param):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value).startswith(f"{param} must")


@pytest.mark.parametrize("kwargs", VALID, ids=[_case_id(c) for c in VALID])
def test_boundary_value_is_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"top_p": 0.0}, "(0, 1]"),
        ({"min_p": 2.0}, "[0, 1]"),
        ({"presence_penalty": 3.0}, "[-2, 2]"),
        ({"logit_bias": {1: 101}}, "[-100, 100]"),
        ({"logprobs": 21}, "[0, 20]"),
        ({"max_tokens": 3, "min_tokens": 4}, "max_tokens=3"),
        ({"temperature": -1.0}, ">= 0"),
    ],
)
def test_error_message_states_the_allowed_range(kwargs, allowed):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert allowed in str(excinfo.value)


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, logit_bias={"42": 3}, stop_token_ids=(7,))
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.logit_bias == {42: 3.0}
    assert params.stop_token_ids == [7]
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (9e-6, True), (1e-5, False), (1.0, False)])
def test_is_greedy_below_epsilon(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_replace_revalidates_and_clone_shares_nothing():
    params = SamplingParams(stop=["x"], logit_bias={1: 2.0}, stop_token_ids=[3])
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(params, top_p=0.0)
    assert dataclasses.replace(params, n=4).n == 4
    copy = params.clone()
    assert copy == params
    copy.stop.append("y")
    copy.logit_bias[5] = 1.0
    copy.stop_token_ids.append(9)
    assert params.stop == ["x"] and params.logit_bias == {1: 2.0} and params.stop_token_ids == [3]


def test_validate_for_vocab():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).validate_for_vocab(100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).validate_for_vocab(100)


def test_verify_max_logprobs():
    SamplingParams(logprobs=20, prompt_logprobs=20).verify_max_logprobs()
    SamplingParams(logprobs=5).verify_max_logprobs(5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=6).verify_max_logprobs(5)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1).verify_max_logprobs(0)


def test_child_seed():
    assert child_seed(1234, 0) == 1234
    children = {child_seed(s, i) for s in range(64) for i in range(16)}
    assert len(children) == 64 * 16, "children of nearby seeds must not collide"
    assert all(0 <= c < 2**64 for c in children)
    assert 0 <= child_seed(-5, 3) < 2**64
    with pytest.raises(ValueError, match="index"):
        child_seed(1, -1)


def test_token_seed_gives_every_position_its_own_stream():
    seeds = {token_seed(s, t) for s in range(32) for t in range(64)}
    assert len(seeds) == 32 * 64 and all(0 <= x < 2**64 for x in seeds)
    assert token_seed(7, 3) == token_seed(7, 3) != token_seed(7, 4)
