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
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.inference_mode()
def test_tiny_checkpoint_matches_transformers(name, gguf_path, tmp_path):
    config_cls, model_cls, extra = ARCHITECTURES[name]
    tokenizer = load_model(gguf_path).tokenizer  # any tokenizer.json will do
    torch.manual_seed(0)
    ref = model_cls(config_cls(vocab_size=tokenizer.vocab_size, **TINY, **extra)).eval()
    if name.startswith("qwen2"):  # random init leaves biases at zero; make them count
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.architecture == ref.config.model_type
    ids = torch.randint(0, tokenizer.vocab_size, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours.model, ids), expected, rtol=1e-4, atol=1e-4)
