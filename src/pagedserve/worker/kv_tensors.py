"""The paged KV tensors the runner (and a draft model) owns: allocation and block copies."""
from __future__ import annotations

import ctypes
import mmap
import threading

import torch

from ..core.kv_plan import check_kv_cache_dtype
from ..core.kv_tensor_layout import KVTensorLayout
from ..model.llama import LlamaModel

# Linux's value (5.14+); Python's mmap module does not export it before 3.13.
_MADV_POPULATE_WRITE = 23

_TORCH_DTYPES = {"auto": torch.float32, "fp32": torch.float32, "fp16": torch.float16,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(name: str, auto: torch.dtype = torch.float32) -> torch.dtype:
    """`auto` is the model's compute dtype (float32 on the CPU path, bfloat16 on CUDA by default)."""
    return auto if check_kv_cache_dtype(name) == "auto" else _TORCH_DTYPES[name]


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
    num_extra_blocks: int = 0, num_extra_layers: int = 0, device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Per layer a cache of zeros, `num_blocks` blocks; the first num_extra_layers layers
    get num_extra_blocks more (a self-draft's scratch)."""
    c = model.config
    layouts = [KVTensorLayout(num_blocks + (num_extra_blocks if i < num_extra_layers else 0), block_size,
                              c.num_kv_heads, c.head_dim, dtype) for i in range(c.num_layers)]
    if device is not None and torch.device(device).type != "cpu":
        return [torch.zeros(layout.shape, dtype=dtype, device=device) for layout in layouts]
    return _committed_in_background(layouts)


def _committed_in_background(layouts: list[KVTensorLayout]) -> list[torch.Tensor]:
    """Zero tensors of `layouts` on one anonymous mapping whose pages a thread of their own
    faults in: the pool is still committed whole at start-up, but start-up no longer waits
    for it (torch.zeros: 0.4-0.5 s for the default 2 GiB on a 2-core EPYC VM, more on a busy
    one). The kernel zeroes each page, so a token written before its page is reached just
    faults that page first; where the kernel lacks MADV_POPULATE_WRITE (before Linux 5.14)
    pages commit on first write instead. Without MAP_NORESERVE the pool is charged against
    the commit limit at once: vm.overcommit_memory=2 refuses it at start-up, not mid-decode."""
    sizes = [layout.nbytes for layout in layouts]
    pages = mmap.mmap(-1, sum(sizes))
    flat = torch.frombuffer(pages, dtype=torch.uint8)
    threading.Thread(target=_populate, args=(pages, flat.data_ptr()), name="pagedserve-kv-commit", daemon=True).start()
    return [part.view(layout.dtype).view(layout.shape) for part, layout in zip(flat.split(sizes), layouts)]


def _populate(pages: mmap.mmap, address: int) -> None:
    """Commit every page of `pages` (mapped at `address`), writable. ctypes releases the GIL
    for the call, and holding `pages` keeps the mapping alive until it returns."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(len(pages)), _MADV_POPULATE_WRITE)


@torch.inference_mode()
def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Block dst[i] becomes a copy of block src[i] in every layer, K and V (gathered
    first, so a block may be a source and, later in the list, a destination)."""
    for kv in kv_caches:
        kv[:, dst] = kv[:, src]
