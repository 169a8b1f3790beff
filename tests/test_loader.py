"""Model resolution, the converted-model cache, and Hugging Face safetensors folders."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from model_utils import prefill_logits
from pagedserve.model.loader import convert_gguf, load_model, resolve_model
from pagedserve.model.weights import hf_tensors_from_gguf


def test_missing_model_names_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="looked for a .gguf file.*config.json"):
        resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_cache_round_trip(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    fresh = convert_gguf(gguf_path)
    cached = convert_gguf(gguf_path)
    assert not fresh.from_cache and cached.from_cache
    assert fresh.config == cached.config
    assert fresh.state.keys() == cached.state.keys()
    assert all(torch.equal(fresh.state[k], cached.state[k]) for k in fresh.state)
    text = "Hello, <|im_start|>world 123 日本"
    assert fresh.tokenizer.encode(text) == cached.tokenizer.encode(text)
    assert [p.name for p in tmp_path.iterdir()] == [fresh.cache_dir.name]  # no staging left behind


def test_hf_safetensors_folder_gives_the_same_logits(gguf_path, gguf_file, tmp_path):
    """Write the GGUF's weights out as an HF checkpoint folder and load that instead."""
    gguf_model = load_model(gguf_path)
    c = gguf_model.config
    hf = hf_tensors_from_gguf(gguf_file.tensors(), c)
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": True,
    }))
    gguf_model.tokenizer.save(tmp_path)
    folder_model = load_model(tmp_path)
    assert folder_model.source.kind == "hf" and folder_model.config == c
    ids = gguf_model.tokenizer.encode("The capital of France is")
    assert folder_model.tokenizer.encode("The capital of France is") == ids
    torch.testing.assert_close(prefill_logits(folder_model.model, ids), prefill_logits(gguf_model.model, ids))
