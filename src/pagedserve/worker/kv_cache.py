"""The paged KV tensors the runner (and a draft model) owns: allocation and block copies."""
from __future__ import annotations

import torch

from ..core.kv_plan import check_kv_cache_dtype
from ..model.llama import LlamaModel

_TORCH_DTYPES = {"auto": torch.float32, "fp32": torch.float32, "fp16": torch.float16,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(name: str, auto: torch.dtype = torch.float32) -> torch.dtype:
    """`auto` is the model's compute dtype (float32 on the CPU path, bfloat16 on CUDA by default)."""
    return auto if check_kv_cache_dtype(name) == "auto" else _TORCH_DTYPES[name]


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
    num_extra_blocks: int = 0, num_extra_layers: int = 0, device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, block_size, kv_heads, head_dim]; the first
    num_extra_layers layers get num_extra_blocks more (a self-draft's scratch)."""
    c = model.config
    return [
        torch.zeros((2, num_blocks + (num_extra_blocks if i < num_extra_layers else 0), block_size,
                     c.num_kv_heads, c.head_dim), dtype=dtype, device=device)
        for i in range(c.num_layers)
    ]


@torch.inference_mode()
def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Block dst[i] becomes a copy of block src[i] in every layer, K and V (gathered
    first, so a block may be a source and, later in the list, a destination)."""
    for kv in kv_caches:
        kv[:, dst] = kv[:, src]
