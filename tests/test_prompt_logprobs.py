"""Prompt logprobs equal the transformers reference's log-softmax at every prompt
position: in one prefill, in small chunks, and after the prefix cache holds the prompt
(such requests recompute it)."""
from __future__ import annotations

import pytest
import torch

from engine_utils import assert_all_blocks_free, make_llm
from pagedserve import SamplingParams
from pagedserve.model.loader import load_model

# Logits match the reference within 1e-3 (test_model_reference.py); a log-softmax is
# the logits minus one logsumexp, so its error is at most twice that.
LOGPROB_ATOL = 2e-3
TOP = 3


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def prompts(reference_prompts) -> list[list[int]]:
    """One token, a few, and 300 (several chunks at the default budget)."""
    return [reference_prompts[0], reference_prompts[2], reference_prompts[-1]]


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1) for ids in prompts]


def _check(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = entries[i], ref[i - 1], prompt[i]
        assert abs(entry[token].logprob - row[token].item()) <= LOGPROB_ATOL, (i, entry[token], row[token])
        # Tokens within the bound of the prompt token's logprob may fall either side of it.
        lowest, highest = int((row > row[token] + LOGPROB_ATOL).sum()) + 1, int((row >= row[token] - LOGPROB_ATOL).sum())
        assert lowest <= entry[token].rank <= highest
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        ref_top = row.topk(k).values.tolist()
        assert len(entry) in (k, k + 1) and len(top) >= k - 1  # the prompt's token may be one of the top k
        for lp, value in zip(top, ref_top):
            assert abs(lp.logprob - value) <= LOGPROB_ATOL


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 40, "max_num_seqs": 8}], ids=["default", "chunks-of-40"])
def test_prompt_logprobs_match_the_reference(loaded, prompts, reference, options):
    llm = make_llm(loaded, **options)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    for out, prompt, ref in zip(llm.generate(prompts, params, use_tqdm=False), prompts, reference):
        _check(out, prompt, ref, TOP)
    assert_all_blocks_free(llm)


def test_a_cached_prefix_is_recomputed(loaded, prompts, reference):
    llm = make_llm(loaded)
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompts[-1]], plain, use_tqdm=False)
    again = llm.generate([prompts[-1]], plain, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0 and again.prompt_logprobs is None
    out = llm.generate([prompts[-1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    _check(out, prompts[-1], reference[-1], 0)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_requests_without_prompt_logprobs_are_unchanged_beside_one_with(loaded, prompts):
    llm = make_llm(loaded, max_num_batched_tokens=64, max_num_seqs=8)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(prompts * 2, [plain] * 3 + [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                     prompt_logprobs=1)] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone] * 2
    assert all(o.prompt_logprobs is None for o in mixed[:3]) and all(o.prompt_logprobs for o in mixed[3:])
    assert_all_blocks_free(llm)
