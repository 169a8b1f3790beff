"""The thinking budget the engine enforces, and structured output that waits for the answer.

A tiny random Llama "thinks" from its first output token (starts_in_reasoning) and its
end marker is made of tokens it does not emit unprompted, so its natural section never
ends: a budget of B must give exactly its natural first B tokens, then the marker, on
every engine shape (paged and contiguous KV, n-gram and draft-model speculation,
preemption in a tiny pool, prefix-cache hits, n > 1). Markers taken from its natural
output show the other cases: a section that ends before the budget, and one that opens
with a start marker.
"""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
import torch

from engine_utils import assert_all_blocks_free, make_llm
from pagedserve import SamplingParams
from pagedserve.core.scheduler_output import ScheduledRequest
from pagedserve.core.reasoning import ReasoningPhase, ReasoningState
from pagedserve.core.request import Request
from pagedserve.model.loader import load_model
from pagedserve.sampling_params import ReasoningMarkers
from pagedserve.sampling_state import SamplingState
from pagedserve.structured_output import StructuredOutputs
from pagedserve.worker.row_sampling import sample_rows
from pagedserve.worker.sampler import build_sampling_metadata, sample
from pooling_reference import save_tiny_llama

MAX_TOKENS = 16
TINY_KV_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # 2 layers, K and V, 2 KV heads of 16, fp32, block 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
SELF_DRAFT = {"method": "draft_model", "model": "self:1", "num_speculative_tokens": 3}
SHAPES = {
    "paged": dict(),
    "contiguous": dict(kv_layout="contiguous"),
    "ngram": dict(speculative_config=NGRAM),
    "draft-model": dict(speculative_config=SELF_DRAFT),
    "preemption": dict(kv_cache_memory=10 * TINY_KV_BYTES_PER_BLOCK, max_num_batched_tokens=64, max_num_seqs=32),
}
BOOL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}


# -- the pieces --------------------------------------------------------------------------


def markers(end, start=()) -> ReasoningMarkers:
    return ReasoningMarkers(tuple(end), not start, tuple(start))


@pytest.mark.parametrize("options, name", [
    (dict(thinking_token_budget=4), "thinking_token_budget"),
    (dict(reasoning=markers([5]), thinking_token_budget=-1), "thinking_token_budget"),
    (dict(reasoning=markers([5]), thinking_token_budget=10**9 + 1), "thinking_token_budget"),
    (dict(reasoning=markers([5]), thinking_token_budget=2.0), "thinking_token_budget"),
    (dict(reasoning=markers([])), "reasoning.end_token_ids"),
    (dict(reasoning=ReasoningMarkers((5,), True, (4,))), "reasoning.start_token_ids"),
    (dict(reasoning=ReasoningMarkers((5,), False)), "reasoning.start_token_ids"),
    (dict(reasoning=markers([5, -1])), "reasoning.end_token_ids"),
    (dict(reasoning=(5,)), "reasoning"),
    (dict(reasoning=markers([5]), beam_width=2, temperature=0), "reasoning"),
])
def test_bad_reasoning_params_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**options)


def test_marker_ids_are_checked_against_the_vocabulary():
    SamplingParams(reasoning=markers([5], start=[4]), thinking_token_budget=0).validate_for_vocab(6)
    with pytest.raises(ValueError, match="reasoning token id 6"):
        SamplingParams(reasoning=markers([5], start=[6])).validate_for_vocab(6)


def test_state_forces_the_marker_at_the_budget_and_completes_a_partial_one():
    state = ReasoningState((7, 8), (), True, 3)
    state.sync([1, 2])
    assert state.forced_token() is None
    state.sync([1, 2, 3])
    assert state.forced_token() == 7
    state.sync([1, 2, 3, 7])
    assert state.forced_token() == 8
    state.sync([1, 2, 3, 7, 8])
    assert state.in_answer and state.forced_token() is None
    partial = ReasoningState((7, 8), (), True, 3)
    partial.sync([1, 2, 7])  # the marker's first token written by the model, at the budget
    assert partial.forced_token() == 8
    natural = ReasoningState((7, 8), (), True, 3)
    natural.sync([7, 8])
    assert natural.in_answer and natural.count == 2


def test_state_opens_at_the_start_marker_and_starts_over_on_shorter_output():
    state = ReasoningState((7,), (4, 5), False, 0)
    state.sync([4, 4, 5])  # the marker after a false start
    assert state.phase is ReasoningPhase.REASONING and state.forced_token() == 7
    state.sync([4])
    assert state.phase is ReasoningPhase.OPENING and state.forced_token() is None
    forced = ReasoningState((7,), (4, 5), False, 0, force_start=True)
    assert forced.forced_token() == 4
    forced.sync([4])
    assert forced.forced_token() == 5


def test_positions_follow_the_drafts_without_moving_the_state():
    state = ReasoningState((7, 8), (5,), False, 2)
    views = state.positions([1, 5, 2, 3, 7, 8, 9])
    assert views == [(None, None)] * 4 + [(7, None), (8, None), (None, 6), (None, 6)]
    assert state.num_seen == 0 and state.phase is ReasoningPhase.OPENING
    assert state.answer_offset([5, 1, 7, 8, 4, 4]) == 4


def test_forced_rows_draw_their_token_greedy_or_sampled_and_report_the_models_logprobs():
    logits = torch.randn(3, 50)
    rows = [(SamplingParams(temperature=0, logprobs=1), [1], [], None),
            (SamplingParams(temperature=1.0, top_p=0.5, logprobs=1), [1], [], None),
            (SamplingParams(temperature=1.0, min_tokens=2), [1], [], None)]
    meta = build_sampling_metadata(rows, 50, eos_token_ids=(9,), forced=[(0, 11), (1, 12), (2, 9)])
    expected = logits.log_softmax(dim=-1)
    out = sample(logits.clone(), meta)
    assert out.sampled_token_ids.tolist() == [11, 12, 9]  # row 2's min_tokens mask does not undo it
    assert out.logprobs.logprobs[:, 0].tolist() == pytest.approx([expected[0, 11].item(), expected[1, 12].item()])


def test_accepted_drafts_past_the_budget_are_cut_and_the_marker_substituted():
    """Logits that favour every draft: the drafts up to the budget are kept, the next
    position takes the marker instead of its draft, and verification stops there."""
    vocab, end = 40, (30, 31)
    params = SamplingParams(temperature=0, reasoning=markers(end), thinking_token_budget=4, max_tokens=20)
    req = Request("r", [0], 20, sampling=SamplingState.for_request(params, [None]))
    for token in (1, 2, 3):
        req.append_output_token(token)
    drafts = (4, 5, 6)
    row = ScheduledRequest(req, "r", 4, 3, False, (), None, 4, False, drafts)
    logits = torch.zeros(4, vocab)
    for j, token in enumerate((*drafts, 7)):
        logits[j, token] = 5.0
    assert sample_rows(logits, [row], np.array([0])).sampled["r"] == [4, 30]
    req.append_output_token(4)
    req.append_output_token(30)
    row = ScheduledRequest(req, "r", 3, 5, False, (), None, 3, False, (31, 9))
    assert sample_rows(torch.zeros(3, vocab), [row], np.array([0])).sampled["r"][:2] == [31, 0]


# -- on the engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(gguf_path, tmp_path_factory):
    """A random Llama whose head is its embedding, scaled: it mostly repeats its last token
    (sampling strays now and then), so n-gram and draft-model proposals get accepted."""
    path = tmp_path_factory.mktemp("tiny-thinking")
    ref = save_tiny_llama(path, load_model(gguf_path).tokenizer)
    with torch.no_grad():
        ref.lm_head.weight.copy_(ref.model.embed_tokens.weight * 8)
    ref.save_pretrained(path)
    return load_model(path)


@pytest.fixture(scope="module")
def prompts(tiny):
    texts = ["Think step by step about the weather in Paris tomorrow and what to wear for it.",
             "Count the prime numbers below one hundred, showing your reasoning before the answer.",
             "Explain why the sky is blue to a child, then give a one-line summary of the idea.",
             "Plan a three-day trip to Rome with a budget, thinking through the costs carefully."]
    return [tiny.tokenizer.encode(t) for t in texts]


def plain_requests() -> list[SamplingParams]:
    """Greedy and seeded requests, each run with and without reasoning markers."""
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)]


def unused_pair(outputs: list[list[int]], vocab: int) -> tuple[int, int]:
    """Two token ids that none of `outputs` holds: an end marker the model never writes itself."""
    seen = {t for out in outputs for t in out}
    free = [t for t in range(1000, vocab) if t not in seen]
    return free[0], free[1]


def generate(llm, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in out.outputs] for out in outs]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_budget_gives_exactly_the_natural_tokens_then_the_marker(tiny, prompts, shape):
    llm = make_llm(tiny, **SHAPES[shape])
    paged = shape != "contiguous"
    base = plain_requests() + ([dataclasses.replace(plain_requests()[1], n=2)] if paged else [])
    natural = {(p, i): samples for p, params in enumerate(base)
               for i, samples in enumerate(generate(llm, prompts, params))}
    end = unused_pair([t for samples in natural.values() for t in samples], tiny.config.vocab_size)
    for budget in (0, 5, MAX_TOKENS - 2, MAX_TOKENS + 4):
        reasoning = [dataclasses.replace(p, reasoning=markers(end), thinking_token_budget=budget) for p in base]
        for p, params in enumerate(reasoning):
            for i, samples in enumerate(generate(llm, prompts, params)):
                for got, want in zip(samples, natural[p, i]):
                    assert got == (want[:budget] + list(end) + got[budget + 2:])[:MAX_TOKENS], (budget, p, i)
    stats = llm.stats()
    if shape == "preemption":
        assert stats["num_preemptions"] > 0, "the tiny pool was meant to force preemption"
    if paged:
        assert stats["prefix_cache_hits"] > 0
    if "speculative_config" in SHAPES[shape]:
        assert stats["spec_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_greedy_tokens_are_the_same_on_every_shape(tiny, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            reasoning=markers((5000, 5001)), thinking_token_budget=6)
    want = generate(make_llm(tiny), prompts, params)
    for shape in ("contiguous", "ngram", "draft-model", "preemption"):
        assert generate(make_llm(tiny, **SHAPES[shape]), prompts, params) == want, shape


def test_markers_from_the_output_end_early_or_open_the_section(tiny, prompts):
    llm = make_llm(tiny)
    seeded = plain_requests()[1]
    natural = [s[0] for s in generate(llm, prompts, seeded)]
    for want, prompt in zip(natural, prompts):
        # The section closes by itself (at tokens 3-4) before a budget of 10: nothing is forced.
        early = dataclasses.replace(seeded, reasoning=markers(want[3:5]), thinking_token_budget=10)
        assert generate(llm, [prompt], early)[0][0] == want
        # A start marker the model writes: a budget of 0 closes the section right after it.
        opened = dataclasses.replace(seeded, reasoning=markers((5000,), start=want[1:3]), thinking_token_budget=0)
        first = next(i for i in range(len(want)) if want[i : i + 2] == want[1:3])
        assert generate(llm, [prompt], opened)[0][0][: first + 3] == [*want[: first + 2], 5000]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("shape", ["paged", "ngram", "draft-model"])
def test_structured_output_constrains_only_the_answer(tiny, prompts, shape):
    """The thinking is the model's own (its natural tokens, which the grammar would refuse),
    the budget closes it, and the answer after the marker is valid JSON for the schema."""
    llm = make_llm(tiny, **SHAPES[shape])
    budget, end = 6, (5000, 5001)
    spec = StructuredOutputs(json=BOOL_SCHEMA)
    grammar = llm.engine.structured_outputs.compile(spec)
    greedy, seeded = (dataclasses.replace(p, max_tokens=24) for p in plain_requests())
    for free in (greedy, seeded, dataclasses.replace(seeded, n=2)):
        params = dataclasses.replace(free, structured_outputs=spec, reasoning=markers(end), thinking_token_budget=budget)
        for out, want in zip(generate(llm, prompts, params), generate(llm, prompts, free)):
            for got, natural in zip(out, want):
                assert got[:budget] == natural[:budget]
                assert grammar.matcher().valid_prefix(natural[:budget]) < budget, "choose a prompt the grammar refuses"
                assert_answer(tiny.tokenizer, got[budget:], end)
    # A start marker with a grammar: the engine opens the section itself.
    opened = dataclasses.replace(seeded, structured_outputs=spec, reasoning=markers(end, start=(4000,)),
                                 thinking_token_budget=budget)
    for out in generate(llm, prompts, opened):
        assert out[0][0] == 4000
        assert grammar.matcher().valid_prefix(out[0][1 : 1 + budget]) < budget
        assert_answer(tiny.tokenizer, out[0][1 + budget:], end)
    assert_all_blocks_free(llm)


def assert_answer(tokenizer, tokens: list[int], end: tuple[int, ...]) -> None:
    """`tokens` are the end marker, then a whole answer valid for BOOL_SCHEMA."""
    assert tuple(tokens[: len(end)]) == end
    jsonschema.validate(json.loads(tokenizer.decode(tokens[len(end):])), BOOL_SCHEMA)
