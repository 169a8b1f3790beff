"""The reference for embedding tests: a tiny random Llama checkpoint that transformers
writes itself (with the shipped tokenizer), and its final hidden states pooled."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def save_tiny_llama(path: Path, tokenizer) -> transformers.LlamaForCausalLM:
    """Write the checkpoint and tokenizer into `path`; return transformers' model of it."""
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, **TINY)).eval()
    ref.save_pretrained(path)
    tokenizer.save(path)
    return ref


def reference_embedding(ref: transformers.LlamaForCausalLM, ids: list[int], pooling: str = "last",
                        normalize: bool = True) -> torch.Tensor:
    """transformers' final hidden states (`hidden_states[-1]`, after the final norm), pooled
    ("last", "mean" or "cls") and L2-normalised if asked."""
    with torch.inference_mode():
        hidden = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
