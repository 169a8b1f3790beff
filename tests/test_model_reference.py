"""pagedserve's Llama forward against the transformers reference on the same GGUF."""
from __future__ import annotations

import pytest
import torch

from conftest import REFERENCE_NEW_TOKENS
from model_utils import greedy_generate, prefill_logits
from pagedserve.attention.backend import ReferenceBackend
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.kernels import resolve_kernels
from pagedserve.model.gguf_file import read_tensors
from pagedserve.model.loader import build_model, convert_gguf
from pagedserve.model.weights import fuse_gguf_blocks

pytestmark = pytest.mark.oracle

# fp32 on both sides; differences come only from summation order. Observed worst
# max |diff| 6.8e-5 over these prompts, on logits of magnitude ~10-40; hold 1e-3.
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module", params=[("blocks", "native"), (True, "native"), (True, "torch"), (False, "torch")],
                ids=["blocks-native", "packed-native", "packed-torch", "plain-torch"])
def model_and_backend(request, gguf_path):
    """Every linear-layer path (the GGUF's blocks multiplied in fp32, the engine's default
    with native kernels; weights prepacked for oneDNN; F.linear) and both kernel paths
    (pagedserve's native ops and attention backend, and pure torch with the per-sequence
    reference attention)."""
    pack, kernels = request.param
    c = convert_gguf(gguf_path)
    if pack == "blocks":
        state, qtypes = fuse_gguf_blocks(read_tensors(gguf_path), c.config)
        model = build_model(c.config, state, qtypes=qtypes)
    else:
        model = build_model(c.config, c.state, pack=pack)
    model.set_kernels(resolve_kernels(kernels))
    return model, NativePagedAttention() if kernels == "native" else ReferenceBackend()


@torch.inference_mode()
def test_logits_match_reference(model_and_backend, hf_model, reference_prompts):
    model, backend = model_and_backend
    worst = 0.0
    for ids in reference_prompts:
        ours = prefill_logits(model, ids, backend)
        ref = hf_model(torch.tensor([ids])).logits[0]
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"len {len(ids)}: max |logit diff| {diff:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    print(f"worst max |logit diff| over prompts: {worst:.2e}")


# The torch variants (the fallback where the native library cannot run) decode through
# per-sequence reference attention, ~7 s a prompt: the default run takes the bare EOS
# prompt, a short one and the 300-token one; `make test-slow` the rest.
TORCH_DEFAULT_PROMPTS = (0, 2, -1)


def assert_greedy_matches(model_and_backend, prompts, references, hf_tokenizer):
    model, backend = model_and_backend
    for ids, ref in zip(prompts, references):
        ours = greedy_generate(model, ids, REFERENCE_NEW_TOKENS, backend)
        # The reference stops after EOS; ours was told to run on.
        assert len(ref) == REFERENCE_NEW_TOKENS or ref[-1] == hf_tokenizer.eos_token_id
        assert ours[: len(ref)] == ref


def chosen(model_and_backend, items: list, default_run: bool) -> list:
    if isinstance(model_and_backend[1], NativePagedAttention):
        return items if default_run else []
    picked = {i % len(items) for i in TORCH_DEFAULT_PROMPTS}
    return [x for i, x in enumerate(items) if (i in picked) == default_run]


@torch.inference_mode()
def test_greedy_continuations_match_reference(model_and_backend, reference_prompts, reference_greedy, hf_tokenizer):
    assert_greedy_matches(model_and_backend, chosen(model_and_backend, reference_prompts, True),
                          chosen(model_and_backend, reference_greedy, True), hf_tokenizer)


@pytest.mark.slow
@torch.inference_mode()
def test_greedy_continuations_match_reference_on_the_other_prompts(model_and_backend, reference_prompts,
                                                                    reference_greedy, hf_tokenizer):
    assert_greedy_matches(model_and_backend, chosen(model_and_backend, reference_prompts, False),
                          chosen(model_and_backend, reference_greedy, False), hf_tokenizer)
