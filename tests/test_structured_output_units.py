"""Structured output without the model's forward: spec validation, the bitmask
application, matcher fork, the compiled-grammar cache and its time limit."""
from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams, StructuredOutputs
from pagedserve.structured_output.logits import advance, apply_bitmask, bitmask_words, constrain



@pytest.fixture(scope="module")
def tokenizer():
    from pagedserve.model.loader import load_model

    return load_model().tokenizer


@pytest.fixture(scope="module")
def manager(tokenizer):
    from pagedserve.structured_output.manager import StructuredOutputManager

    return StructuredOutputManager(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 3}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"json_object": 1}, "structured_outputs.json_object"),
])
def test_invalid_specs_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_spec_keys():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    # The dict and its JSON text are one cache entry; property order is kept (the output follows it).
    assert StructuredOutputs(json=schema).key == StructuredOutputs(json='{"type": "object", "properties": '
                                                                       '{"b": {"type": "string"}, "a": '
                                                                       '{"type": "integer"}}}').key
    assert StructuredOutputs(json=schema).json.index('"b"') < StructuredOutputs(json=schema).json.index('"a"')
    assert StructuredOutputs(json_object=True).key == ("json", '{"type": "object"}')
    assert StructuredOutputs(choice=["x", "y"]).key == ("choice", '["x", "y"]')


def test_sampling_params_takes_only_a_structured_outputs():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="a+"))
    assert params.clone().structured_outputs == params.structured_outputs


def test_apply_bitmask_matches_a_per_token_reference():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 5, 1000  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    logits = torch.randn(rows, vocab, generator=gen)
    expected = logits.clone()
    for r in range(rows):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    full = logits.clone()
    apply_bitmask(full, bitmask)
    assert torch.equal(full, expected)
    # Only some rows constrained: the others keep their logits.
    partial = logits.clone()
    apply_bitmask(partial, bitmask[[1, 3]], torch.tensor([1, 3]))
    assert torch.equal(partial[[1, 3]], expected[[1, 3]])
    assert torch.equal(partial[[0, 2, 4]], logits[[0, 2, 4]])


def allowed(matcher, vocab: int) -> set[int]:
    bitmask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_matcher_follows_the_grammar_and_forks(manager, tokenizer):
    vocab = tokenizer.vocab_size
    matcher = manager.matchers(StructuredOutputs(regex="ab(c|d)"), 1)[0]
    start = allowed(matcher, vocab)
    assert all(tokenizer.decode([t]).startswith("a") or t in tokenizer.stop_token_ids for t in start)
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    assert matcher.accept([a, b]) and not matcher.is_terminated
    fork = matcher.fork()
    assert matcher.accept([c]) and matcher.is_terminated
    assert allowed(matcher, vocab) <= set(tokenizer.stop_token_ids)  # complete: only EOS may follow
    assert not fork.is_terminated  # the fork did not move with its source
    assert fork.accept([tokenizer.encode("d", add_special_tokens=False)[0]]) and fork.is_terminated
    fresh = manager.matchers(StructuredOutputs(regex="ab(c|d)"), 1)[0]
    assert not fresh.accept([c]) and fresh.error  # 'c' cannot come first
    assert fresh.is_terminated


def test_constrain_masks_only_constrained_rows(manager, tokenizer):
    vocab = tokenizer.vocab_size
    matcher = manager.matchers(StructuredOutputs(choice=["yes", "no"]), 1)[0]
    logits = torch.zeros(3, vocab)
    assert constrain(logits, [None, matcher, None]) == [1]
    assert torch.all(logits[[0, 2]] == 0)
    allowed_ids = torch.nonzero(logits[1] == 0).flatten().tolist()
    assert allowed_ids and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed_ids)
    assert constrain(torch.zeros(2, vocab), [None, None]) == []
    yes = tokenizer.encode("yes", add_special_tokens=False)
    advance(matcher, yes[:1])
    assert not matcher.error


def test_constrain_after_drafts_masks_each_position_without_moving_the_matcher(manager, tokenizer):
    vocab = tokenizer.vocab_size
    matcher = manager.matchers(StructuredOutputs(choice=["red apple", "green"]), 1)[0]
    red = tokenizer.encode("red apple", add_special_tokens=False)
    bad = tokenizer.encode("green", add_special_tokens=False)[0]
    logits = torch.zeros(4, vocab)
    # Positions after drafts (), (red0,), (red0, red1); and after a refused draft.
    rows = constrain(logits, [matcher] * 4, [(), tuple(red[:1]), tuple(red[:2]), (bad, bad)])
    assert rows == [0, 1, 2, 3]
    allowed = [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]
    assert red[0] in allowed[0] and red[1] in allowed[1] and red[0] not in allowed[1]
    assert len(allowed[3]) == vocab  # unmasked: its sample can never be kept
    assert not matcher.error and matcher.accept(red)  # the matcher itself never moved


def test_compiled_grammars_are_cached(manager):
    spec = StructuredOutputs(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    assert manager.compile(spec) is manager.compile(StructuredOutputs(json=spec.json))
    with pytest.raises(ValueError, match="invalid regex"):
        manager.compile(StructuredOutputs(regex="[z-a]"))


def test_compile_time_limit_is_a_value_error(tokenizer):
    from pagedserve.structured_output.manager import StructuredOutputManager

    # A fresh manager's first compile also builds the backend's tokenizer (a good part
    # of a second), far beyond this limit; the caller gets a ValueError, not a wait.
    slow = StructuredOutputManager(tokenizer, tokenizer.vocab_size, compile_timeout=0.001)
    with pytest.raises(ValueError, match="took longer than"):
        slow.compile(StructuredOutputs(regex="[0-9]+"))


def test_missing_backend_package_is_a_value_error(tokenizer, monkeypatch):
    import sys

    from pagedserve.structured_output.registry import make_backend

    # As on an install without the `guided` extra: importing llguidance fails.
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.delitem(sys.modules, "pagedserve.structured_output.llguidance_backend", raising=False)
    with pytest.raises(ValueError, match=r"pagedserve\[guided\]"):
        make_backend("llguidance", tokenizer, tokenizer.vocab_size)
    with pytest.raises(ValueError, match="backend must be one of"):
        make_backend("xgrammar", tokenizer, tokenizer.vocab_size)
