"""Random LoRA adapters in PEFT's format for a model's architecture, for benchmarks and tests.

PEFT builds the adapter on transformers' Llama module tree (built on the meta device: no
base weights are allocated), so the files are exactly what `save_pretrained` writes for a
fine-tune of that model; only the adapter's own A and B are materialised, with seeded
normal values (B non-zero, unlike PEFT's default initialisation, so the adapter changes
the model's outputs).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..model.config import ModelConfig

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: str | Path, config: ModelConfig, *, rank: int, alpha: float,
                         targets: Sequence[str] = ALL_PROJECTIONS, seed: int = 0, use_rslora: bool = False,
                         b_std: float = 0.02) -> Path:
    """Write adapter_config.json + adapter_model.safetensors into `folder`; return it.
    A ~ N(0, 1/in_features) and B ~ N(0, b_std^2)."""
    import peft
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    lora_config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                                  bias="none", use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    for name, module in sorted(peft_model.named_modules(), key=lambda item: item[0]):
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 2)[-2] in ("lora_A", "lora_B"):
            module.to_empty(device="cpu")
            std = module.in_features**-0.5 if ".lora_A." in name else b_std
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
    folder = Path(folder)
    peft_model.save_pretrained(folder)
    return folder
