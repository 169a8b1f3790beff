"""Putting a loaded model on its device, in its dtype, with FP8 weights if asked.

The CPU path with fp32 weights never comes here: its model is used as loaded (oneDNN-packed).
"""
from __future__ import annotations

import torch

from .fp8 import Fp8Linear
from .llama import Linear, LlamaModel


def place_model(model: LlamaModel, device: torch.device, dtype: torch.dtype, quantization: str = "none",
                max_positions: int | None = None, fp8_granularity: str = "channel") -> LlamaModel:
    """Move `model` (unpacked weights) to `device` and `dtype`, in place, and tabulate RoPE for
    `max_positions` there. quantization "fp8": every decoder linear layer becomes an Fp8Linear
    (scales from the weights at the model's dtype); the head and embedding keep `dtype`."""
    packed = [path for path, m in model.named_linears() if isinstance(m, Linear) and m.weight is None]
    if packed:
        raise ValueError(f"{packed[0]} holds a oneDNN-packed weight, which only the CPU reads; "
                         "load the model with pack=False to place it")
    # RoPE's frequency divisors stay fp32 (Module.to would round them to the new dtype).
    divisors = [rotary.freq_divisors.float().cpu() for rotary in model.rotaries()]
    model.to(device=device, dtype=dtype)
    for rotary, kept in zip(model.rotaries(), divisors):
        rotary.set_freq_divisors(kept)
        rotary.place(device, dtype, max_positions or model.config.max_position_embeddings)
    if quantization == "fp8":
        for path, module in model.named_linears():
            if path != "lm_head" and isinstance(module, Linear):
                model.set_submodule(path, Fp8Linear(module.weight.detach(), module.bias, fp8_granularity))
    return model
