"""Idefics3 / SmolVLM: a SigLIP tower (model/siglip.py), a pixel-shuffle connector, and a
Llama text decoder that is pagedserve's LlamaModel, loaded like any Llama.

A Hugging Face folder's config.json (model_type "idefics3") holds the text decoder's
config under text_config and the tower's under vision_config; its safetensors hold
`model.text_model.*` (the decoder, renamed here to a Llama checkpoint's `model.*`),
`lm_head.weight`, `model.vision_model.*` and `model.connector.*`. The decoder then takes
every path a Llama takes (quantisation, 16-bit weights kept as stored, placement); the
tower and the connector stay in float32 until placed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .siglip import SiglipConfig, SiglipTower

MODEL_TYPE = "idefics3"
_TEXT_PREFIX, _VISION_PREFIXES = "model.text_model.", ("model.vision_model.", "model.connector.")


def is_idefics3(config_json: Path) -> bool:
    return json.loads(config_json.read_text()).get("model_type") == MODEL_TYPE


def check_processor_seq_len(folder: Path, image_seq_len: int) -> None:
    """processor_config.json's image_seq_len, where it gives one, must be the model's (the
    tokens a tile becomes); a folder whose processor disagrees is refused, naming both."""
    path = folder / "processor_config.json"
    given = json.loads(path.read_text()).get("image_seq_len") if path.is_file() else None
    if given is not None and given != image_seq_len:
        raise ValueError(f"{path}: image_seq_len {given!r}, but the model's tiles are {image_seq_len} tokens each")


@dataclass(frozen=True)
class Idefics3Config:
    text: ModelConfig
    vision: SiglipConfig
    scale_factor: int
    image_token_id: int

    @property
    def image_seq_len(self) -> int:
        """Tokens per tile: the patch grid after the connector's pixel shuffle."""
        return self.vision.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], what: str) -> "Idefics3Config":
        text_cfg = dict(cfg.get("text_config") or {})
        if text_cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"{what}: an idefics3 text_config of model_type {text_cfg.get('model_type')!r} is "
                             "not supported (llama is)")
        text_cfg.setdefault("model_type", "llama")
        # The top level decides whether the head is tied (Idefics3ForConditionalGeneration's).
        text_cfg["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
        text = ModelConfig.from_hf_dict(text_cfg, f"{what} text_config")
        v = cfg.get("vision_config") or {}
        if int(v.get("num_channels", 3)) != 3:
            raise ValueError(f"{what}: vision_config.num_channels must be 3 (RGB), got {v['num_channels']!r}")
        try:
            vision = SiglipConfig(
                hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
                num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
                image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
                layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)), hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")))
        except KeyError as e:
            raise ValueError(f"{what}: vision_config key {e} is missing") from None
        scale = int(cfg.get("scale_factor", 2))
        if scale < 1 or vision.patches_per_side % scale:
            raise ValueError(f"{what}: scale_factor ({scale}) must divide the {vision.patches_per_side} patches "
                             "per side of a tile")
        image_token_id = int(cfg["image_token_id"]) if "image_token_id" in cfg else None
        if image_token_id is None or not 0 <= image_token_id < text.vocab_size:
            raise ValueError(f"{what}: image_token_id must be a token id below vocab_size, got {image_token_id!r}")
        return cls(text, vision, scale, image_token_id)


class Connector(nn.Module):
    """Pixel shuffle (each scale x scale square of patches into one vector), then a linear
    projection into the text decoder's hidden size."""

    def __init__(self, config: Idefics3Config):
        super().__init__()
        self.scale = config.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(config.vision.hidden_size * self.scale ** 2,
                                                  config.text.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, dim = x.shape
        side, s = int(seq ** 0.5), self.scale
        x = x.view(n, side, side // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, seq // (s * s), dim * s * s))


class Idefics3Vision(nn.Module):
    """An image's tiles [N, 3, S, S] -> the text decoder's embeddings of its image tokens,
    [N * image_seq_len, text hidden], in the order the prompt's image tokens take them."""

    def __init__(self, config: Idefics3Config):
        super().__init__()
        self.config = config
        self.vision_model = SiglipTower(config.vision)
        self.connector = Connector(config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        param = self.connector.modality_projection.proj.weight
        features = self.connector(self.vision_model(pixel_values.to(param.device, param.dtype)))
        return features.reshape(-1, features.shape[-1])


def split_checkpoint(hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the text decoder's tensors under a Llama checkpoint's names, the tower's and the
    connector's under Idefics3Vision's); a tensor of neither is an error, naming it."""
    text, vision = {}, {}
    for name, tensor in hf.items():
        if name.startswith(_TEXT_PREFIX):
            text["model." + name.removeprefix(_TEXT_PREFIX)] = tensor
        elif name == "lm_head.weight":
            text[name] = tensor
        elif name.startswith(_VISION_PREFIXES):
            vision[name.removeprefix("model.")] = tensor.float()
        else:
            raise ValueError(f"unexpected tensor {name!r} in an idefics3 checkpoint")
    return text, vision


def build_vision(config: Idefics3Config, state: dict[str, torch.Tensor]) -> Idefics3Vision:
    with torch.device("meta"):
        vision = Idefics3Vision(config)
    vision.load_state_dict(state, strict=True, assign=True)
    return vision.eval().requires_grad_(False)
