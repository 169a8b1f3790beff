"""Every RoPE scaling type against transformers, Llama- and Qwen3-shaped, past the original
context; the same scalings from GGUF metadata; and what is not implemented refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from model_utils import greedy_generate, prefill_logits
from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_write import write_gguf
from pagedserve.model.loader import load_model
from pagedserve.model.weights import hf_tensors_from_safetensors

transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
SHAPES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24))}
# An original context of 32 under a 100-token prompt and its decode: most positions lie past it.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-betas-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                          "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.3, "mscale_all_dim": 0.7},
    "yarn-attention-factor-untruncated": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 32,
                                          "attention_factor": 1.25, "truncate": False},
    "yarn-factor-from-context": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    # pagedserve serves LongRoPE at its original context (model/rope.py): 128 here. Its
    # factors, one per rotated pair of dims, are filled in by tiny_pair.
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 128},
}
PROMPT, NEW_TOKENS = 100, 12


def tiny_pair(shape: str, scaling: dict, folder, tokenizer):
    """A random transformers model with `scaling`, saved to `folder`, and pagedserve's load of it."""
    config_cls, model_cls, extra = SHAPES[shape]
    torch.manual_seed(0)
    rope = {**scaling, "rope_theta": 10000.0}
    if rope["rope_type"] == "longrope":
        pairs = extra.get("head_dim", TINY["hidden_size"] // TINY["num_attention_heads"]) // 2
        rope.update(short_factor=[1.0 + 0.1 * i for i in range(pairs)], long_factor=[4.0] * pairs)
    ref = model_cls(config_cls(vocab_size=tokenizer.vocab_size, rope_parameters=rope, **{**TINY, **extra})).eval()
    ref.save_pretrained(folder)
    tokenizer.save(folder)
    return ref, load_model(folder)


@torch.inference_mode()
def reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each step a whole forward (no cache of its own)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(ref(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_model(gguf_path).tokenizer


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_scaling_matches_transformers_past_the_original_context(shape, scaling, tokenizer, tmp_path):
    ref, ours = tiny_pair(shape, SCALINGS[scaling], tmp_path, tokenizer)
    assert ours.config.rope_scaling["rope_type"] == SCALINGS[scaling]["rope_type"]
    ids = torch.randint(0, tokenizer.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours.model, ids), expected, rtol=1e-4, atol=1e-4)
    assert greedy_generate(ours.model, ids, NEW_TOKENS) == reference_greedy(ref, ids, NEW_TOKENS)


def test_the_scaling_changes_the_tokens(tokenizer, tmp_path):
    """The comparison above can fail: without YaRN the same weights give other logits."""
    ref, ours = tiny_pair("qwen3", SCALINGS["yarn"], tmp_path, tokenizer)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plain = load_model(tmp_path)
    ids = list(range(1000, 1000 + PROMPT))
    assert not torch.allclose(prefill_logits(plain.model, ids), prefill_logits(ours.model, ids), atol=1e-3)


def test_rope_scaling_in_the_older_form_reads_the_same(tokenizer, tmp_path):
    _, ours = tiny_pair("qwen3", SCALINGS["yarn-betas-mscale"], tmp_path, tokenizer)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_hf_config(tmp_path / "config.json") == ours.config
    assert ModelConfig.from_hf_config(tmp_path / "config.json").rope_scaling == ours.config.rope_scaling


@torch.inference_mode()
def test_dynamic_is_refused_past_max_position_embeddings(tokenizer, tmp_path):
    _, ours = tiny_pair("llama", SCALINGS["dynamic"], tmp_path, tokenizer)
    with pytest.raises(ValueError, match="dynamic.*max_position_embeddings"):
        prefill_logits(ours.model, [5] * (TINY["max_position_embeddings"] + 1))


def test_longrope_is_served_at_its_original_context(tokenizer, tmp_path):
    _, ours = tiny_pair("llama", SCALINGS["longrope"], tmp_path, tokenizer)
    assert ours.config.max_position_embeddings == 128


@pytest.mark.parametrize("shape, scaling", [("qwen3", "yarn"), ("llama", "yarn-betas-mscale"), ("qwen3", "linear"),
                                            ("llama", "llama3")])
@torch.inference_mode()
def test_gguf_with_scaling_metadata_gives_the_folders_tokens(shape, scaling, tokenizer, gguf_path, tmp_path):
    _, folder = tiny_pair(shape, SCALINGS[scaling], tmp_path / "hf", tokenizer)
    write_gguf(tmp_path / "model.gguf", folder.config, hf_tensors_from_safetensors(tmp_path / "hf"), gguf_path,
               lambda name, shape: GGMLQuantizationType.F32)
    from_gguf = load_model(tmp_path / "model.gguf", use_cache=False)
    if scaling != "llama3":  # a llama3 file carries its divisors as the rope_freqs tensor
        assert from_gguf.config.rope_scaling["rope_type"] == SCALINGS[scaling]["rope_type"]
    ids = torch.randint(0, tokenizer.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(prefill_logits(from_gguf.model, ids), prefill_logits(folder.model, ids),
                               rtol=1e-5, atol=1e-5)
    assert greedy_generate(from_gguf.model, ids, NEW_TOKENS) == greedy_generate(folder.model, ids, NEW_TOKENS)


def _hf_config(**extra) -> dict:
    return {**TINY, "model_type": "qwen3", "vocab_size": 1000, "head_dim": 16, **extra}


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "rope_type 'ntk-by-parts' is not implemented"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "extrapolation_factor": 0.5},
     r"rope_scaling.extrapolation_factor=0.5 is not implemented for rope_type 'yarn'"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 2.0}, "rope_scaling.low_freq_factor"),
    ({"rope_type": "dynamic", "factor": 2.0, "alpha": 3.0}, "rope_scaling.alpha"),
])
def test_unimplemented_rope_scaling_is_refused_by_name(rope, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig._from_hf_config(_hf_config(rope_parameters={**rope, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match=match):
        ModelConfig._from_hf_config(_hf_config(rope_scaling=rope))


def _gguf_metadata(**scaling) -> dict:
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
            "qwen3.vocab_size": 1000, "qwen3.block_count": 2, "qwen3.feed_forward_length": 96,
            "qwen3.context_length": 256}
    return {**meta, **{f"qwen3.rope.scaling.{k}": v for k, v in scaling.items()}}


def test_gguf_yarn_metadata_reads_as_transformers_fields():
    config = ModelConfig.from_gguf_metadata(_gguf_metadata(
        type="yarn", factor=4.0, original_context_length=32, yarn_attn_factor=1.1, yarn_beta_fast=16.0,
        yarn_beta_slow=2.0, yarn_ext_factor=1.0, finetuned=True))
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                   "attention_factor": 1.1, "beta_fast": 16.0, "beta_slow": 2.0}


@pytest.mark.parametrize("scaling, match", [
    (dict(type="yarn", factor=4.0, original_context_length=32, yarn_ext_factor=0.5), "yarn_ext_factor=0.5"),
    (dict(type="yarn", factor=4.0, original_context_length=32, yarn_log_multiplier=0.1), "yarn_log_multiplier"),
    (dict(type="linear", factor=2.0, alpha=1000.0), "rope.scaling.alpha"),
    (dict(type="longrope", original_context_length=32), "type 'longrope' is not implemented"),
    (dict(type="linear", factor=2.0, attn_factor=0.5), "rope.scaling.attn_factor"),
    (dict(type="yarn", factor=4.0), "original_context_length is required"),
])
def test_unimplemented_gguf_rope_metadata_is_refused_by_name(scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(_gguf_metadata(**scaling))


def test_write_gguf_refuses_what_gguf_metadata_cannot_say(tokenizer, gguf_path, tmp_path):
    _, folder = tiny_pair("llama", SCALINGS["yarn-attention-factor-untruncated"], tmp_path / "hf", tokenizer)
    with pytest.raises(ValueError, match="truncate false"):
        write_gguf(tmp_path / "model.gguf", folder.config, hf_tensors_from_safetensors(tmp_path / "hf"), gguf_path,
                   lambda name, shape: GGMLQuantizationType.F32)
