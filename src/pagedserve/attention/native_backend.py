"""Paged attention on pagedserve's native ops (kernels/csrc/paged_attention.cpp).

The step's new K/V reach the cache through the fused `write_kv_` op; then every query
row of the step (decodes, speculative verification rows, prefill chunks of any length)
goes to one `paged_attention_` call that reads K/V in place through the block tables:
no gather, no padding to a group's longest context, one read of each KV head's rows for
all the query heads that share it, and the context split across threads at fixed
256-key partitions.

Why prefill chunks too: a row's bits then depend only on its query and the K/V stored
before it, never on how its prompt was chunked or what else shares the step. torch's
flash attention, which long chunks took before, blocks its keys by the chunk's length,
so the same prompt cut into other chunks (alone, or beside other requests' decodes)
stored slightly different K/V; a narrow cache's rounding then turned that into other
greedy tokens (an fp8_e4m3 cache on AMD Zen 4). At the CPU default budget (256 tokens a
step) the native op is as fast as the flash path or faster on the chunks a step holds
(docs/notebook/2026-rounds.md, "2026-12-03: prefill chunks on the native attention op").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import native_unavailable_reason
from .backend import PlannedBackend
from .metadata import AttentionMetadata


@dataclass(slots=True)
class NativeStepPlan:
    meta: AttentionMetadata
    seqs: torch.Tensor  # int64: the sequences with new tokens


class NativePagedAttention(PlannedBackend[NativeStepPlan]):
    """The backend when kernels resolve to "native". The step's plan is built once per
    metadata object and reused by every layer."""

    name = "native"
    masks = True
    attention_sinks = True

    def __init__(self) -> None:
        reason = native_unavailable_reason()
        if reason is not None:
            raise ValueError(f"the native attention backend cannot run: {reason}")
        super().__init__()

    def _make_plan(self, meta: AttentionMetadata) -> NativeStepPlan:
        for i, (qlen, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if qlen > seq_len:
                raise ValueError(f"sequence {i}: query_len {qlen} exceeds seq_len {seq_len}")
        seqs = [i for i, qlen in enumerate(meta.query_lens_cpu) if qlen]
        return NativeStepPlan(meta, torch.tensor(seqs, dtype=torch.int64))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = self.start_forward(q, kv_cache, meta, window, softcap, sinks)
        torch.ops.pagedserve.write_kv_(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if plan.seqs.numel():
            torch.ops.pagedserve.paged_attention_(
                out, q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, plan.seqs, scale,
                window, softcap, None if sinks is None else sinks.float().contiguous())
        return out
