"""A step's host-built inputs sent to the device in one copy, from a pinned buffer.

The runner builds a step's integer inputs on the host with numpy (token ids, positions, slot
mapping, logits rows, query starts, sequence lengths, block tables). On a GPU, seven small
pageable copies would each be a synchronous transfer; instead they are packed into one
pinned int64 buffer and sent with a single asynchronous copy, then viewed apart on the device.

Reusing the pinned buffer is safe: the step reads its sampled tokens back before the next
step packs, and that read waits for every copy queued before it on the stream.
On CPU the runner never calls this: its tensors are already where the model runs.
"""
from __future__ import annotations

import dataclasses

import torch

from ..attention.metadata import AttentionMetadata


class DeviceInputs:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        # Only a CUDA host can pin; elsewhere (tests on CPU) the same packing runs unpinned.
        self._pin = device.type == "cuda"
        self._pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)

    def send(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
             meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The same tensors on the device (the metadata's host lists stay as they are)."""
        parts = [input_ids, positions, logits_indices, meta.query_start_loc, meta.seq_lens,
                 meta.slot_mapping, meta.block_tables.reshape(-1)]
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        if total > self._pinned.numel():
            self._pinned = torch.empty(max(total, 2 * self._pinned.numel()), dtype=torch.int64, pin_memory=self._pin)
        host = self._pinned[:total]
        torch.cat(parts, out=host)
        ids, positions, logits_indices, qsl, seq_lens, slots, tables = host.to(
            self.device, non_blocking=True).split(sizes)
        meta = dataclasses.replace(meta, query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=slots,
                                   block_tables=tables.view(meta.block_tables.shape))
        return ids, positions, logits_indices, meta
