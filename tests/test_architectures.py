"""Every supported architecture against transformers: tiny random checkpoints written by
transformers itself, loaded back through pagedserve's HF-folder path."""
from __future__ import annotations

import pytest
import torch

from model_utils import prefill_logits
from pagedserve.model.gguf_rewrite import copy_metadata
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
    # Qwen2 windows the layers from max_window_layers on, and only under use_sliding_window.
    "qwen2-sliding-layers": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        use_sliding_window=True, sliding_window=32, max_window_layers=1)),
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


def write_gguf_like_llama_cpp(ref, arch: str, path, tokenizer_gguf) -> None:
    """The checkpoint as llama.cpp's converter writes it, in F32: its tensor names (gguf's
    own name map), Gemma's norms stored as 1 + weight, the tokenizer of `tokenizer_gguf`."""
    import gguf

    c = ref.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    copy_metadata(gguf.GGUFReader(tokenizer_gguf), writer, keep=lambda key: key.startswith("tokenizer."))
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        writer.add_rope_dimension_count(int(head_dim * c.rope_parameters["partial_rotary_factor"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, tensor in ref.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["gemma2-softcap-sliding", "phi3-partial-rope-sliding"])
@torch.inference_mode()
def test_gguf_written_like_llama_cpp_gives_the_hf_folders_tokens(name, gguf_path, tmp_path):
    from model_utils import greedy_generate

    config_cls, model_cls, extra = ARCHITECTURES[name]
    tokenizer = load_model(gguf_path).tokenizer
    torch.manual_seed(0)
    # A GGUF carries no query_pre_attn_scalar: llama.cpp scales by head_dim (Gemma 2's 2B and
    # 9B are so made), so the checkpoint here is too.
    ref = model_cls(config_cls(vocab_size=tokenizer.vocab_size, **{**TINY, **extra, "query_pre_attn_scalar": 16})).eval()
    ref.save_pretrained(tmp_path / "hf")
    tokenizer.save(tmp_path / "hf")
    arch = ref.config.model_type
    write_gguf_like_llama_cpp(ref, arch, tmp_path / "model.gguf", gguf_path)
    from_folder, from_gguf = load_model(tmp_path / "hf"), load_model(tmp_path / "model.gguf", use_cache=False)
    assert from_gguf.config.architecture == arch
    for field in ("sliding_window", "sliding_layers", "attn_logit_softcapping", "final_logit_softcapping",
                  "query_pre_attn_scalar", "partial_rotary_factor"):
        if arch == "gemma2" or field in ("sliding_window", "partial_rotary_factor"):
            assert getattr(from_gguf.config, field) == getattr(from_folder.config, field), field
    ids = torch.randint(0, tokenizer.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(prefill_logits(from_gguf.model, ids), prefill_logits(from_folder.model, ids),
                               rtol=1e-5, atol=1e-5)
    assert greedy_generate(from_gguf.model, ids, 12) == greedy_generate(from_folder.model, ids, 12)
