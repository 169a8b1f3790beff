"""The paged KV tensors the runner (and a draft model) owns: allocation and block copies."""
from __future__ import annotations

import torch

from ..model.llama import LlamaModel


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, num_extra_blocks: int = 0, num_extra_layers: int = 0
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, block_size, kv_heads, head_dim]; the first
    num_extra_layers layers get num_extra_blocks more (a self-draft's scratch)."""
    c = model.config
    return [
        torch.zeros((2, num_blocks + (num_extra_blocks if i < num_extra_layers else 0), block_size,
                     c.num_kv_heads, c.head_dim), dtype=torch.float32)
        for i in range(c.num_layers)
    ]


@torch.inference_mode()
def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Block dst[i] becomes a copy of block src[i] in every layer, K and V (gathered
    first, so a block may be a source and, later in the list, a destination)."""
    for kv in kv_caches:
        kv[:, dst] = kv[:, src]
