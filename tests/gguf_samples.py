"""Small, valid GGUF files: one built in memory for the model-file fuzzers to damage, and
a transformers model written as llama.cpp's converter writes it, in any types."""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from pagedserve.model.gguf_rewrite import copy_metadata, quantize_as

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


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the loader's undo_llama_cpp_permute inverts it)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_gguf_from_hf(path: Path, model, tokenizer_gguf: Path,
                       choose: Callable[[str, tuple[int, ...]], GGMLQuantizationType]) -> None:
    """A transformers LlamaForCausalLM written as a llama GGUF the way llama.cpp's converter
    writes one (its names, q/k rows permuted), each tensor in choose(gguf name, shape), with
    the tokenizer of `tokenizer_gguf` (whose vocabulary the model's must be)."""
    from pagedserve.model.weights import _hf_name_for_gguf

    c = model.config
    writer = GGUFWriter(path, "llama")
    copy_metadata(GGUFReader(tokenizer_gguf), writer, prefix="tokenizer.")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    names = ["token_embd.weight", "output_norm.weight", *([] if c.tie_word_embeddings else ["output.weight"])]
    names += [f"blk.{i}.{n}.weight" for i in range(c.num_hidden_layers) for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    state = model.state_dict()
    for name in names:
        w = state[_hf_name_for_gguf(name)].float().numpy()
        if ".attn_q." in name or ".attn_k." in name:
            w = _llama_cpp_permute(w, c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads)
        data = quantize_as(np.ascontiguousarray(w), choose(name, w.shape))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=choose(name, w.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
