"""Paged attention on pagedserve's native ops (kernels/csrc/paged_attention.cpp).

Every short query (decodes, speculative verification rows, prefill chunks below
PREFILL_MIN_QUERY_LEN) goes to one `paged_attention_` call that reads K/V in place
through the block tables: no gather, no padding to a group's longest context, one
read of each KV head's rows for all the query heads that share it, and the context
split across threads when there are fewer sequences than threads. A long prefill
chunk keeps CpuPagedAttention's path: torch's flash attention, causal over the
chunk's own K/V, merged with its cached context by log-sum-exp. The step's new K/V
reach the cache through the fused `write_kv_` op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import native_unavailable_reason
from .backend import check_step
from .cpu_backend import PrefillChunk, attend_prefill, max_gathered_blocks, split_step, workspace_for
from .metadata import AttentionMetadata


@dataclass(slots=True)
class NativeStepPlan:
    meta: AttentionMetadata
    short_seqs: torch.Tensor  # int64: the sequences the native op attends
    prefills: list[PrefillChunk]
    max_gathered_blocks: int


class NativePagedAttention:
    """The backend when kernels resolve to "native". As with CpuPagedAttention, the
    step's plan is built once per metadata object and reused by every layer."""

    name = "native"

    def __init__(self) -> None:
        reason = native_unavailable_reason()
        if reason is not None:
            raise ValueError(f"the native attention backend cannot run: {reason}")
        self._plan: NativeStepPlan | None = None
        self._workspace = torch.empty(0)

    def prepare(self, meta: AttentionMetadata) -> NativeStepPlan:
        if self._plan is None or self._plan.meta is not meta:
            short, prefills = split_step(meta)
            self._plan = NativeStepPlan(
                meta, torch.tensor(short, dtype=torch.int64), prefills, max_gathered_blocks([], prefills)
            )
        return self._plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        check_step(q, kv_cache, meta)
        plan = self.prepare(meta)
        torch.ops.pagedserve.write_kv_(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if plan.short_seqs.numel():
            torch.ops.pagedserve.paged_attention_(
                out, q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, plan.short_seqs, scale
            )
        if plan.prefills:
            self._workspace = workspace_for(self._workspace, kv_cache, plan.max_gathered_blocks)
            for chunk in plan.prefills:
                attend_prefill(chunk, q, k, v, kv_cache, self._workspace, out, scale, native_merge=True)
        return out
