"""Speculative decoding end to end: proposals, exact verification, rollback, metrics.

Greedy output must not change with speculation (either method, alone and in a busy
batch, with small chunks and forced preemption); the accepted tokens of sampled rows
must follow the target's distribution (chi-square on controlled logits); nothing leaks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import REFERENCE_NEW_TOKENS
from engine_utils import KV_BYTES_PER_BLOCK, assert_all_blocks_free, busy_batch, make_llm
from pagedserve import SamplingParams
from pagedserve.core.scheduler_output import ScheduledRequest
from pagedserve.core.request import Request
from pagedserve.model.loader import load_model
from pagedserve.sampling_state import SamplingState
from pagedserve.spec_decode.spec_config import SpeculativeConfig
from pagedserve.spec_decode.acceptance_stats import SpecDecodeStats
from pagedserve.spec_decode.ngram import propose_ngram
from pagedserve.worker.row_sampling import sample_rows

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft_model", "model": "self:12", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def loaded():
    return load_model()


# -- pieces ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 2, 4) == [7, 5, 1]
    assert propose_ngram([5, 6, 5], 3, 1, 2) == [6, 5]
    assert propose_ngram([1, 2, 3, 4], 2, 1, 3) == []
    assert propose_ngram([4, 4, 4, 4], 8, 2, 2) == [4]  # only what exists after the match


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse('{"num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="self:N"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "self:x"})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse({"method": "ngram", "lookahead": 3})
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    assert SpeculativeConfig.parse('{"method": "draft_model", "model": "self:4"}').self_draft_layers == 4


def test_metrics_arithmetic():
    stats = SpecDecodeStats(3)
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.accepted_per_pos == [2, 1, 1]
    assert stats.acceptance_rate == 0.5 and stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)


# -- the verification rule keeps the target's distribution -------------------------------

CHI2_DF5_P001 = 20.515  # critical value: 6 categories, p = 0.001


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["temperature", "top-k"])
def test_accepted_tokens_follow_the_target_distribution(params):
    """Drafts (2, 3) against fixed logits per position: the first emitted token, the
    second given the first draft was accepted, and the bonus token are each distributed
    as the target's processed distribution at that position."""
    torch.manual_seed(0)
    vocab, num = 6, 12_000
    position_logits = torch.tensor([[1.0, 0.5, 2.0, 0.0, -1.0, 1.5],
                                    [0.0, 1.0, 0.5, 2.5, 0.2, 0.0],
                                    [2.0, -0.5, 0.0, 1.0, 1.0, 0.3]])
    scaled = position_logits / params.temperature
    if params.top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k, dim=-1).values[:, -1:], float("-inf"))
    target = scaled.softmax(dim=-1).numpy().astype(np.float64)
    drafts = (2, 3)
    rows = []
    for i in range(num):
        req = Request(f"r{i}", [0], 10, sampling=SamplingState(params, None))
        rows.append(ScheduledRequest(req, req.request_id, 3, 0, False, (), None, 3, False, drafts))
    logits = position_logits.repeat(num, 1)
    sampled = sample_rows(logits, rows, np.arange(num) * 3).sampled
    out = [sampled[f"r{i}"] for i in range(num)]
    first = np.bincount([t[0] for t in out], minlength=vocab)
    assert chi_square(first[target[0] > 0], target[0][target[0] > 0]) < CHI2_DF5_P001
    second = np.bincount([t[1] for t in out if len(t) > 1], minlength=vocab)
    assert second.sum() == first[2]  # a second token exactly when draft 1 was accepted
    assert chi_square(second[target[1] > 0], target[1][target[1] > 0]) < CHI2_DF5_P001
    bonus = np.bincount([t[2] for t in out if len(t) > 2], minlength=vocab)
    assert bonus.sum() == second[3] > 300
    assert chi_square(bonus[target[2] > 0], target[2][target[2] > 0]) < CHI2_DF5_P001
    assert all(len(t) < 2 or t[0] == 2 for t in out) and all(len(t) < 3 or t[1] == 3 for t in out)


# -- the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self-draft"])
def test_greedy_output_is_unchanged_by_speculation(loaded, spec, reference_prompts, reference_greedy):
    llm = make_llm(loaded, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=REFERENCE_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(reference_prompts, params, use_tqdm=False)
    for out, ref in zip(outs, reference_greedy):
        assert out.outputs[0].token_ids[: len(ref)] == ref
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "spec, options",
    [
        (NGRAM, dict(max_num_batched_tokens=32, max_num_seqs=32)),
        (SELF_DRAFT, dict(kv_cache_memory=48 * KV_BYTES_PER_BLOCK, max_num_batched_tokens=64, max_num_seqs=16)),
    ],
    ids=["ngram-small-chunks", "self-draft-preemption"],
)
def test_busy_batch_is_the_same_with_and_without_speculation(loaded, spec, options):
    """Greedy and seeded rows, prefix-cache hits, n > 1; under preemption for self-draft.
    Seeded sampling gives the same tokens with speculation as without."""
    plain = make_llm(loaded, **options)
    spec_llm = make_llm(loaded, speculative_config=spec, **options)
    prompts, params = busy_batch(plain.tokenizer)
    prompts, params = prompts[:16], params[:16]
    params[3] = SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    again = spec_llm.generate(prompts, params, use_tqdm=False)  # now with prefix-cache hits
    # Greedy and seeded rows alike: a seeded token depends on its seed and position only.
    for i in range(len(params)):
        for a, b, c in zip(want[i].outputs, got[i].outputs, again[i].outputs):
            assert a.token_ids == b.token_ids == c.token_ids, f"request {i}"
    stats = spec_llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["prefix_cache_hits"] > 0
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0
    assert_all_blocks_free(spec_llm)


def test_stop_string_inside_accepted_drafts_cuts_the_output(loaded):
    text = "alpha beta gamma delta epsilon zeta eta theta"
    prompt = f"Repeat: {text}. Repeat: {text}. Repeat:"
    plain = make_llm(loaded)
    spec_llm = make_llm(loaded, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=24, stop=["delta"])
    a = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = spec_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    assert spec_llm.stats()["spec_num_accepted_tokens"] > 0
    assert_all_blocks_free(spec_llm)


def test_logprobs_are_reported_for_every_accepted_token(loaded):
    prompt = "one two three four five one two three four five one two three"
    llm = make_llm(loaded, speculative_config=NGRAM)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    assert all(tok in entry and entry[tok].rank == 1 for tok, entry in zip(out.token_ids, out.logprobs))
    assert llm.stats()["spec_num_accepted_tokens"] > 0


def test_separate_draft_model_keeps_its_own_cache(loaded, gguf_path):
    """The embedded model loaded again as a draft: its own weights and KV cache, kept
    up to date by running it over every step's tokens."""
    llm = make_llm(loaded, max_num_seqs=8, speculative_config={"method": "draft_model", "model": str(gguf_path),
                                                              "num_speculative_tokens": 2})
    prompt = "The capital of France is"
    want = make_llm(loaded).generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = llm.stats()
    assert stats["spec_acceptance_rate"] > 0.9  # the same weights propose what the target samples
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="self:30"):
        make_llm(loaded, speculative_config={"method": "draft_model", "model": "self:30"})


def test_structured_output_composes_with_speculation(loaded):
    """The grammar masks every verified position: constrained greedy output is the same
    with drafts (some of which the grammar refuses) as without."""
    from pagedserve import StructuredOutputs

    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer"}}, "required": ["colour", "count"]}
    prompt = 'Answer in JSON like {"colour": "red", "count": 3}. {"colour": "red", "count": 3} Now you:'
    params = SamplingParams(temperature=0, max_tokens=24,
                            structured_outputs=StructuredOutputs(json=schema))
    want = make_llm(loaded).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    spec_llm = make_llm(loaded, speculative_config=NGRAM)
    got = spec_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) and got.finish_reason == "stop"
    assert spec_llm.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(spec_llm)
