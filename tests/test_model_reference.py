"""pagedserve's Llama forward against the transformers reference on the same GGUF."""
from __future__ import annotations

import pytest
import torch

from conftest import REFERENCE_NEW_TOKENS
from model_utils import greedy_generate, prefill_logits
from pagedserve.model.loader import build_model, convert_gguf

pytestmark = pytest.mark.oracle

# fp32 on both sides; differences come only from summation order. Observed worst
# max |diff| 6.8e-5 over these prompts, on logits of magnitude ~10-40; hold 1e-3.
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module", params=[True, False], ids=["packed", "plain"])
def model(request, gguf_path):
    """Both linear-layer paths: weights prepacked for oneDNN (the default) and F.linear."""
    c = convert_gguf(gguf_path)
    return build_model(c.config, c.state, pack=request.param)


@torch.inference_mode()
def test_logits_match_reference(model, hf_model, reference_prompts):
    worst = 0.0
    for ids in reference_prompts:
        ours = prefill_logits(model, ids)
        ref = hf_model(torch.tensor([ids])).logits[0]
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"len {len(ids)}: max |logit diff| {diff:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    print(f"worst max |logit diff| over prompts: {worst:.2e}")


@torch.inference_mode()
def test_greedy_continuations_match_reference(model, reference_prompts, reference_greedy, hf_tokenizer):
    for ids, ref in zip(reference_prompts, reference_greedy):
        ours = greedy_generate(model, ids, REFERENCE_NEW_TOKENS)
        # The reference stops after EOS; ours was told to run on.
        assert len(ref) == REFERENCE_NEW_TOKENS or ref[-1] == hf_tokenizer.eos_token_id
        assert ours[: len(ref)] == ref
