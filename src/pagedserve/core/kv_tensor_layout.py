"""One layer's KV cache tensor, described once: `KVTensorLayout`.

A layer's cache is one contiguous tensor of `shape` [2, num_blocks, block_size,
num_kv_heads, head_dim]: K at index 0 and V at index 1, then a block's slots, then each
slot's KV heads. Both KV layouts store their layers so (the paged pool hands out any
block; the contiguous one gives a request consecutive blocks), the native ops check that
shape, and every Python reader and writer (the attention backends, the Triton kernels'
wrapper, the KV connector, the worker's allocation) takes its sizes from here rather than
indexing a shape by position.

Pure Python, so every layer may import it: a tensor is anything with `shape`, `dtype`,
`view` and indexing (a torch.Tensor), and a dtype anything with `itemsize` (a torch.dtype).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

KV = 2  # K and V


class ElementType(Protocol):
    @property
    def itemsize(self) -> int: ...


class LayerTensor(Protocol):
    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> Any: ...

    def view(self, *shape: int) -> Any: ...

    def __getitem__(self, index: Any) -> Any: ...


TensorT = TypeVar("TensorT", bound=LayerTensor)


@dataclass(frozen=True, slots=True)
class KVTensorLayout:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: ElementType

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "num_blocks" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'num_blocks' else 'positive'} "
                                 f"integer, got {value!r}")

    @classmethod
    def of(cls, kv_cache: LayerTensor) -> KVTensorLayout:
        """The layout of an existing layer cache; ValueError for any other shape."""
        shape = tuple(kv_cache.shape)
        if len(shape) != 5 or shape[0] != KV:
            raise ValueError(f"a layer's KV cache must be [{KV}, num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got shape {shape}")
        return cls(*shape[1:], kv_cache.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.blocks_shape(self.num_blocks)

    def blocks_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """K and V of `num_blocks` blocks in this layout: a gather's buffer, a transfer's payload."""
        return (KV, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def token_shape(self) -> tuple[int, int]:
        """One token's K (or V): its KV heads' rows."""
        return (self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """K and V of one block."""
        return KV * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def slot_rows(self, blocks: TensorT) -> TensorT:
        """Blocks of this layout (the whole cache, or a gather of some) as [2, slots,
        num_kv_heads, head_dim]: the cache's slot s (the slot mapping's numbering) is row s."""
        return blocks.view(KV, -1, *self.token_shape)

    @staticmethod
    def keys(kv_cache: TensorT) -> TensorT:
        return kv_cache[0]

    @staticmethod
    def values(kv_cache: TensorT) -> TensorT:
        return kv_cache[1]
