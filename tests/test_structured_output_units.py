"""Structured output without the model's forward: spec validation, the bitmask
application, matcher fork, the compiled-grammar cache and its time limit, and the
runner's redraw of a token the grammar's matcher refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import SamplingParams, StructuredOutputs
from pagedserve.core.scheduler_output import ScheduledRequest
from pagedserve.core.request import Request
from pagedserve.sampling_state import SamplingState
from pagedserve.structured_output.grammar_backend import Matcher
from pagedserve.structured_output.logits import advance, apply_bitmask, bitmask_words, constrain
from pagedserve.worker.row_sampling import sample_rows

# A choice SmolLM2 cannot spell (its byte f1 has no token), and the tokens of its spellable start.
UNSPELLABLE = "\u008e\u00c3\u009a\U0007ff69"
UNSPELLABLE_PREFIX_TOKENS = [141, 232, 31173, 141, 244]


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

    from pagedserve.structured_output.backend_registry import make_backend

    # As on an install without the `guided` extra: importing llguidance fails.
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.delitem(sys.modules, "pagedserve.structured_output.llguidance_backend", raising=False)
    with pytest.raises(ValueError, match=r"pagedserve\[guided\]"):
        make_backend("llguidance", tokenizer, tokenizer.vocab_size)
    with pytest.raises(ValueError, match="backend must be one of"):
        make_backend("xgrammar", tokenizer, tokenizer.vocab_size)


class MaskAllowsMore(Matcher):
    """A matcher whose mask also allows `refused`, which its consume then refuses (the
    llguidance defect class the runner guards against); every other token is fine."""

    def __init__(self, refused: set[int], vocab: int):
        self.refused, self.vocab, self.consumed, self._error = refused, vocab, [], None

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def valid_prefix(self, token_ids):
        return next((i for i, t in enumerate(token_ids) if t in self.refused), len(token_ids))

    def accept(self, token_ids):
        n = self.valid_prefix(token_ids)
        self.consumed.extend(token_ids[:n])
        if n < len(token_ids):
            self._error = f"token {token_ids[n]} refused"
        return self._error is None

    def fork(self):
        return MaskAllowsMore(self.refused, self.vocab)

    @property
    def is_terminated(self):
        return self._error is not None

    @property
    def error(self):
        return self._error


def scheduled(req, num_new=1, num_samples=1, drafts=()):
    return ScheduledRequest(req, req.request_id, num_new, 0, False, (), None, num_samples, False, tuple(drafts))


def test_a_token_the_matcher_refuses_is_redrawn_from_the_rest_of_the_row():
    vocab = 8
    params = SamplingParams(temperature=0, logprobs=2)
    matcher = MaskAllowsMore({3, 5}, vocab)
    plain = Request("plain", [0], 10, sampling=SamplingState(params, None))
    grammar = Request("grammar", [0], 10, sampling=SamplingState(params, None, matcher=matcher))
    logits = torch.tensor([[0.0, 1, 2, 9, 3, 8, 4, 5]]).repeat(2, 1)
    out = sample_rows(logits, [scheduled(plain), scheduled(grammar)], np.array([0, 1]))
    # Greedy: 3, then 5 are refused, so the grammar row takes the next best, 7.
    assert out.sampled == {"plain": [3], "grammar": [7]} and matcher.consumed == [7] and not matcher.error
    assert out.logprobs.token_ids[1, 0] == 7 and out.logprobs.sampled_ranks[1] == 1  # ranked among what remains
    assert out.logprobs.token_ids[0, 0] == 3


def test_speculative_and_forked_rows_keep_only_what_the_grammar_accepts():
    vocab = 8
    greedy = SamplingParams(temperature=0)
    matcher = MaskAllowsMore({5}, vocab)
    spec = Request("spec", [0], 10, sampling=SamplingState(greedy, None, matcher=matcher))
    # Drafts (2, 5): the target agrees with both, but 5 is refused at position 1 and redrawn.
    logits = torch.tensor([[0.0, 0, 9, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 9, 0, 0], [9.0, 0, 0, 0, 0, 0, 0, 0]])
    out = sample_rows(logits, [scheduled(spec, 3, 3, (2, 5))], np.array([0]))
    assert out.sampled == {"spec": [2, 4]} and matcher.consumed == [2, 4]
    forks = [MaskAllowsMore({1}, vocab), MaskAllowsMore(set(), vocab)]
    parent = Request("fork", [0], 10, n=2, sampling=SamplingState(greedy, None, [None, None], forks[0], forks))
    out = sample_rows(torch.tensor([[0.0, 9, 8, 0, 0, 0, 0, 0]]).repeat(2, 1), [scheduled(parent, 1, 2)], np.array([0]))
    assert out.sampled == {"fork": [2, 1]} and forks[0].consumed == [2] and forks[1].consumed == [1]


def test_a_row_with_nothing_left_keeps_the_refused_token_last_and_fails_its_matcher():
    vocab = 4
    matcher = MaskAllowsMore({0, 1, 2, 3}, vocab)
    req = Request("r", [0], 10, sampling=SamplingState(SamplingParams(temperature=0), None, matcher=matcher))
    out = sample_rows(torch.tensor([[0.0, 3, 2, 1]]), [scheduled(req)], np.array([0]))
    assert out.sampled == {"r": [1]} and matcher.error == "token 1 refused" and matcher.consumed == []


def test_llguidance_mask_allows_a_token_its_matcher_refuses(manager, tokenizer):
    """The upstream defect, pinned so that a fixed llguidance shows here: the choice's
    byte f1 has no token in SmolLM2's vocabulary, yet the mask allows byte bf."""
    matcher = manager.matchers(StructuredOutputs(choice=[UNSPELLABLE]), 1)[0]
    assert matcher.accept(UNSPELLABLE_PREFIX_TOKENS)
    assert allowed(matcher, tokenizer.vocab_size) == {140}
    assert matcher.valid_prefix([140]) == 0 and not matcher.error
