"""Model shapes by name (from each model's published config.json), or read from a
config.json / model folder / GGUF file; a GGUF's bytes per weight as it stores them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..model.config import ModelConfig


def _shape(arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, max_pos: int, tied: bool, rope_theta: float) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope_theta=rope_theta, max_position_embeddings=max_pos,
                       tie_word_embeddings=tied, attention_bias=arch == "qwen2")


MODELS: dict[str, ModelConfig] = {
    "llama-3.3-70b": _shape("llama", 128_256, 8192, 28_672, 80, 64, 8, 128, 131_072, False, 500_000.0),
    "llama-3.1-8b": _shape("llama", 128_256, 4096, 14_336, 32, 32, 8, 128, 131_072, False, 500_000.0),
    "qwen2.5-7b": _shape("qwen2", 152_064, 3584, 18_944, 28, 28, 4, 128, 32_768, False, 1_000_000.0),
    "smollm2-135m": _shape("llama", 49_152, 576, 1536, 30, 9, 3, 64, 8192, True, 100_000.0),
}


def load_model(spec: str) -> ModelConfig:
    """A name from MODELS, a config.json (or a folder holding one), or a .gguf file."""
    if spec in MODELS:
        return MODELS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.exists():
        from ..model.gguf_file import GGUFFile  # numpy + gguf, never torch

        return ModelConfig.from_gguf(GGUFFile(path))
    if path.exists():
        return ModelConfig.from_hf_config(path)
    raise ValueError(f"model must be one of {', '.join(MODELS)} or a config.json / .gguf path; got {spec!r}")



@dataclass(frozen=True)
class StoredWeights:
    """Bytes per weight as a GGUF stores them (the engine holds its blocks at 0.98-1.04x the
    file: docs/kernels.md): the decoder's tensors, and the LM head (the tied embedding where
    the file has no output.weight; an untied embedding is priced as the head)."""

    body: float
    head: float


def stored_weights(spec: str) -> StoredWeights:
    """The bytes per weight of a .gguf file's own types (Q4_K_M's mix, say)."""
    if not (spec.endswith(".gguf") and Path(spec).is_file()):
        raise ValueError(f"dtype 'gguf' prices a GGUF file's own types: model must be a .gguf path, got {spec!r}")
    from ..model.gguf_file import GGUFFile  # numpy + gguf, never torch

    tensors = GGUFFile(spec).tensors()
    head_name = "output.weight" if any(t.name == "output.weight" for t in tensors) else "token_embd.weight"
    body = [t for t in tensors if t.name not in ("output.weight", "token_embd.weight")]
    head = next(t for t in tensors if t.name == head_name)
    return StoredWeights(sum(t.raw.nbytes for t in body) / sum(math.prod(t.shape) for t in body),
                         head.raw.nbytes / math.prod(head.shape))
