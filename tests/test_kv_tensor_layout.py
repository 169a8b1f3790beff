"""KVTensorLayout against the tensors it describes: the worker's allocation, the slot
numbering the attention writes use, the bytes a block costs, and clear refusals."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.core.kv_tensor_layout import KVTensorLayout
from pagedserve.worker.kv_tensors import allocate_kv_caches


def test_shape_and_bytes_are_those_of_the_tensor():
    layout = KVTensorLayout(num_blocks=5, block_size=4, num_kv_heads=3, head_dim=8, dtype=torch.float16)
    cache = torch.zeros(layout.shape, dtype=layout.dtype)
    assert cache.shape == (2, 5, 4, 3, 8)
    assert KVTensorLayout.of(cache) == layout
    assert layout.nbytes == cache.numel() * cache.element_size() == 5 * layout.block_bytes
    assert layout.block_bytes == cache[:, 0].numel() * 2
    assert layout.blocks_shape(2) == cache[:, :2].shape
    assert layout.token_shape == cache[0, 0, 0].shape


def test_slot_rows_number_slots_as_the_slot_mapping_does():
    layout = KVTensorLayout(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=5, dtype=torch.float32)
    cache = torch.randn(layout.shape)
    rows = layout.slot_rows(cache)
    block, offset = 2, 3
    slot = block * layout.block_size + offset
    assert torch.equal(rows[0, slot], layout.keys(cache)[block, offset])
    assert torch.equal(rows[1, slot], layout.values(cache)[block, offset])
    rows[1, slot] = 7.0  # a view: writes land in the cache
    assert torch.all(cache[1, block, offset] == 7.0)


def test_allocation_follows_the_layout():
    model = SimpleNamespace(config=SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=4))  # all it reads
    caches = allocate_kv_caches(model, num_blocks=6, block_size=4, dtype=torch.float16,
                                num_extra_blocks=2, num_extra_layers=1)
    assert [KVTensorLayout.of(c) for c in caches] == [KVTensorLayout(8, 4, 2, 4, torch.float16),
                                                       KVTensorLayout(6, 4, 2, 4, torch.float16)]


@pytest.mark.parametrize("shape", [(5, 4, 3, 8), (3, 5, 4, 3, 8)])
def test_another_shape_is_refused_by_name(shape):
    with pytest.raises(ValueError, match=r"\[2, num_blocks, block_size, num_kv_heads, head_dim\]"):
        KVTensorLayout.of(torch.zeros(shape))


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_dim", "num_blocks"])
def test_a_bad_size_is_refused_by_name(field):
    sizes = {"num_blocks": 2, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match=field):
        KVTensorLayout(**{**sizes, field: -1}, dtype=torch.float32)
