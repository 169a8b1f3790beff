"""Gemma 2 and Gemma 3 (text): the Llama layer with Gemma's differences.

- Four norms a layer: the attention's and the MLP's outputs are normed again before
  their residual adds (HF's post_attention_layernorm and post_feedforward_layernorm; its
  pre_feedforward_layernorm is our ffn_norm). Gemma's RMSNorm multiplies by 1 + weight:
  the loader stores 1 + weight (as llama.cpp's converter does), so RMSNorm runs unchanged.
- GeGLU: GELU's tanh approximation of gate, times up.
- The embedding scaled by sqrt(hidden_size); Gemma 2's final logits soft-capped.
- Sliding-window layers between global ones; Gemma 3's sliding layers rotate with their
  own RoPE base (`rope_local_theta`), its global ones with `rope_theta` and its scaling.
Attention's scale (query_pre_attn_scalar), soft-capping and window are DecoderLayer's
options, read from the config (model/variants.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.backend import AttentionBackend
from ..attention.metadata import AttentionMetadata
from .config import ModelConfig
from .llama import DecoderLayer, LlamaModel, RMSNorm, RotaryEmbedding
from .lora import LoRABatch


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__(config, index)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend, lora: tuple[LoRABatch, int] | None = None
                ) -> torch.Tensor:
        out = self.attention(self.attn_norm(hidden), cos, sin, kv_cache, meta, backend, lora)
        hidden, normed = self.ffn_norm.add_forward(self.post_attn_norm(out), hidden)
        return hidden.add_(self.post_ffn_norm(self.mlp(normed, lora)))

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GemmaModel(LlamaModel):
    layer_class = GemmaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_logit_softcapping
        with torch.device("cpu"):
            # Gemma 3's sliding layers: their own base, no scaling (the divisors stay ones).
            self.local_rotary = RotaryEmbedding(config, config.rope_local_theta) if config.rope_local_theta else None

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] if self.local_rotary is None else [self.rotary, self.local_rotary]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata, backend: AttentionBackend, lora: LoRABatch | None = None,
                      inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """LlamaModel's, with the scaled embedding and the local layers' own RoPE; no
        Gemma here has a vision tower, so image rows (`inputs_embeds`) are refused."""
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: Gemma models here take no images")
        hidden = self.embed(input_ids) * self.embed_scale
        global_cs = self.rotary.cos_sin(positions)
        local_cs = global_cs if self.local_rotary is None else self.local_rotary.cos_sin(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            cos, sin = local_cs if layer.window else global_cs
            hidden = layer(hidden, cos, sin, kv_cache, meta, backend, None if lora is None else (lora, i))
        return hidden
