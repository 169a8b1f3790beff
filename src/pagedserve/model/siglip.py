"""The SigLIP vision tower as Idefics3 / SmolVLM run it: square tiles of pixels into one
hidden state per patch.

It is not paged: a tile's patches attend to each other bidirectionally, all at once, in
plain torch (scaled_dot_product_attention), and the tower runs once per image (the
engine caches its output by content hash: worker/image_embeds.py). The module and
parameter names are Hugging Face's (`vision_model.*` of Idefics3Model), so a checkpoint
loads with load_state_dict as stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Hugging Face's hidden_act names -> torch's GELU `approximate` argument.
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_act not in _GELU:
            raise ValueError(f"vision_config.hidden_act must be one of {', '.join(_GELU)}, got {self.hidden_act!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config.image_size ({self.image_size}) must be a multiple of "
                             f"patch_size ({self.patch_size})")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.patch_size, self.per_side = config.patch_size, config.patches_per_side
        self.patch_embedding = nn.Conv2d(3, config.hidden_size, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(self.per_side ** 2, config.hidden_size)

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Idefics3's NaViT-style ids: a tile of rows x cols patches takes the learned
        positions of a per_side x per_side grid at its patches' fractional coordinates
        (the identity when the tile is image_size square)."""
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device)

        def buckets(n: int) -> torch.Tensor:
            coords = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(n, device=device))
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

        return (buckets(rows)[:, None] * self.per_side + buckets(cols)[None, :]).reshape(-1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, patches, hidden]."""
        embeds = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        rows, cols = pixel_values.shape[2] // self.patch_size, pixel_values.shape[3] // self.patch_size
        return embeds + self.position_embedding(self.position_ids(rows, cols, pixel_values.device))


class SiglipAttention(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, h // config.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (p(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)  # bidirectional: no mask
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class SiglipMLP(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.approximate = _GELU[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipLayer(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(config) for _ in range(config.num_layers))


class SiglipTower(nn.Module):
    """Tiles [N, 3, H, W] (H, W multiples of patch_size) -> [N, patches, hidden], after the
    post-layernorm."""

    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
