"""pagedserve's Llama forward against the transformers reference on the same GGUF."""
from __future__ import annotations

import pytest
import torch

from model_utils import greedy_generate, prefill_logits
from pagedserve.model.loader import build_model, convert_gguf

pytestmark = pytest.mark.oracle

# fp32 on both sides; differences come only from summation order. Observed worst
# max |diff| 6.8e-5 over these prompts, on logits of magnitude ~10-40; hold 1e-3.
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def model(gguf_path):
    c = convert_gguf(gguf_path)
    return build_model(c.config, c.state)


def _prompts(hf_tokenizer) -> list[list[int]]:
    texts = [
        "Hi",
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time, in a small village nestled between two mountains, there lived a",
        "日本の首都は東京です。フランスの首都は",
        "1, 2, 3, 5, 8, 13, 21, 34,",
    ]
    ids = [hf_tokenizer(t)["input_ids"] for t in texts]
    ids.append([ids[4][i % len(ids[4])] for i in range(300)])  # 300 tokens, repetitive
    ids.insert(0, [hf_tokenizer.eos_token_id])  # a single token
    return ids


@torch.inference_mode()
def test_logits_match_reference(model, hf_model, hf_tokenizer):
    worst = 0.0
    for ids in _prompts(hf_tokenizer):
        ours = prefill_logits(model, ids)
        ref = hf_model(torch.tensor([ids])).logits[0]
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"len {len(ids)}: max |logit diff| {diff:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    print(f"worst max |logit diff| over prompts: {worst:.2e}")


@torch.inference_mode()
def test_greedy_continuations_match_reference(model, hf_model, hf_tokenizer):
    for ids in _prompts(hf_tokenizer)[:8]:
        ours = greedy_generate(model, ids, 32)
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=hf_tokenizer.eos_token_id
        )[0, len(ids):].tolist()
        # The reference stops after EOS; ours was told to run on for all 32.
        assert len(ref) == 32 or ref[-1] == hf_tokenizer.eos_token_id
        assert ours[: len(ref)] == ref
