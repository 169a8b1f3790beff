"""Small, valid GGUF files: one built in memory for the model-file fuzzers to damage, and
a transformers model written as llama.cpp's converter writes it, in any types."""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_write import write_gguf

TOKENS = ["<|endoftext|>", "a", "b", "c", "ab", "Ġ", "Ġa", "bc"]
MERGES = ["a b", "Ġ a", "b c"]


def sample_gguf_bytes(weights: np.ndarray | None = None) -> bytes:
    """A llama-architecture GGUF with a few metadata kinds, string arrays (a byte-level
    BPE vocabulary) and an F32, an F16 and a Q8_0 tensor."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sample.gguf"
        writer = GGUFWriter(path, "llama")
        writer.add_block_count(1)
        writer.add_embedding_length(32)
        writer.add_feed_forward_length(64)
        writer.add_head_count(4)
        writer.add_context_length(128)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(TOKENS)
        writer.add_token_types([3] + [1] * (len(TOKENS) - 1))
        writer.add_token_merges(MERGES)
        writer.add_eos_token_id(0)
        embed = rng.standard_normal((len(TOKENS), 32)).astype(np.float32) if weights is None else weights
        writer.add_tensor("token_embd.weight", embed)
        writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
        q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
        writer.add_tensor("blk.0.ffn_up.weight", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def llama_gguf_from_hf(path: Path, model, tokenizer_gguf: Path,
                       choose: Callable[[str, tuple[int, ...]], GGMLQuantizationType]) -> None:
    """A transformers LlamaForCausalLM written as a llama GGUF the way llama.cpp's converter
    writes one (gguf_write.write_gguf), each matrix in choose(gguf name, shape), with the
    tokenizer of `tokenizer_gguf` (whose vocabulary the model's must be)."""
    config_json = Path(path).with_suffix(".config.json")
    model.config.to_json_file(config_json)
    write_gguf(path, ModelConfig.from_hf_config(config_json), model.state_dict(), tokenizer_gguf, choose)
