"""Every supported architecture against transformers: tiny random checkpoints written by
transformers itself, loaded back through pagedserve's HF-folder path."""
from __future__ import annotations

import pytest
import torch

from model_utils import prefill_logits
from pagedserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCHITECTURES = {
    "llama-untied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama3-rope-scaling": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2-qkv-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
    # Windows of 32 keys under a 120-token prompt, so the window decides what layers see.
    "mistral-sliding": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=32)),
    "phi3-partial-rope-sliding": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        sliding_window=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5})),
    "phi3-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        original_max_position_embeddings=128, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.25 * i for i in range(6)], "long_factor": [4.0] * 6})),
    # Caps near the scores' and logits' own size, so soft-capping changes them.
    "gemma2-softcap-sliding": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, sliding_window=32, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
        final_logit_softcapping=0.5, num_hidden_layers=3, initializer_range=0.1)),
    "gemma3-local-global-rope": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=16, sliding_window=32, query_pre_attn_scalar=24, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
# Where pagedserve's architecture name differs from HF's model_type.
OUR_NAMES = {"gemma3_text": "gemma3"}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.inference_mode()
def test_tiny_checkpoint_matches_transformers(name, gguf_path, tmp_path):
    config_cls, model_cls, extra = ARCHITECTURES[name]
    tokenizer = load_model(gguf_path).tokenizer  # any tokenizer.json will do
    torch.manual_seed(0)
    ref = model_cls(config_cls(vocab_size=tokenizer.vocab_size, **{**TINY, **extra})).eval()
    if name.startswith("qwen2"):  # random init leaves biases at zero; make them count
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.architecture == OUR_NAMES.get(ref.config.model_type, ref.config.model_type)
    ids = torch.randint(0, tokenizer.vocab_size, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours.model, ids), expected, rtol=1e-4, atol=1e-4)
