"""Attention over the contiguous KV layout: each sequence's K/V is one contiguous view.

Under the contiguous layout (worker/contiguous_kv_memory.py) a sequence's blocks are consecutive
in the layer's cache, so its first block id is a base pointer and positions
0 .. seq_len - 1 are the rows base .. base + seq_len - 1 of the flattened cache. Nothing
is gathered and no block table is walked:

- a decode (one query token) is one flash-attention call over the view of its whole
  context (its own new K/V was just written there);
- any longer query (speculative verification, prefill chunks) attends causally to its
  own K/V and, unmasked, to the view of its earlier context, merged by log-sum-exp
  (cpu_backend.attend_chunk, with a view in place of a gather).

`NativeContiguousAttention` sends every query to the native paged op instead: given
tables of consecutive blocks it reads each context as one sequential stream, with all
queries of the step in one parallel call (the per-sequence torch calls cost ~0.1 ms each
per layer), and a row's bits do not depend on how its prompt was chunked
(attention/native_backend.py says why that matters); it takes the op's sliding windows,
soft-capping and attention sinks too. docs/kv-layouts.md has the measurements.

The torch path has no sliding window or soft-capping (refused); a layer with attention
sinks (gpt-oss) takes backend.attend_each_sequence there, through the consecutive tables.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.kv_tensor_layout import KVTensorLayout
from ..kernels import native_unavailable_reason
from .backend import PlannedBackend, attend_each_sequence, write_kv
from .cpu_backend import attend_chunk
from .metadata import AttentionMetadata


@dataclass(slots=True)
class ContiguousStepPlan:
    meta: AttentionMetadata
    # Per sequence with new tokens: (first q row, query_len, seq_len, first cache row).
    short: list[tuple[int, int, int, int]]
    chunks: list[tuple[int, int, int, int]]
    short_seqs: torch.Tensor  # int64: the indices of the short ones


def plan_step(meta: AttentionMetadata, short_below: int) -> ContiguousStepPlan:
    """Sequences with queries shorter than short_below go to the backend's short path."""
    starts = meta.query_start_loc.tolist()
    bases = (meta.block_tables[:, 0] * meta.block_size).tolist() if meta.num_seqs else []
    short, chunks, short_seqs = [], [], []
    for i, (qlen, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if qlen > seq_len:
            raise ValueError(f"sequence {i}: query_len {qlen} exceeds seq_len {seq_len}")
        if qlen == 0:
            continue
        item = (starts[i], qlen, seq_len, bases[i])
        if qlen < short_below:
            short.append(item)
            short_seqs.append(i)
        else:
            chunks.append(item)
    return ContiguousStepPlan(meta, short, chunks, torch.tensor(short_seqs, dtype=torch.int64))


class ContiguousAttention(PlannedBackend[ContiguousStepPlan]):
    """The contiguous layout on torch kernels: decodes are its short queries."""

    name = "contiguous"
    short_below = 2
    masks = False
    attention_sinks = True

    def _make_plan(self, meta: AttentionMetadata) -> ContiguousStepPlan:
        return plan_step(meta, self.short_below)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = self.start_forward(q, kv_cache, meta, window, softcap, sinks)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if sinks is not None:  # torch's flash kernel has no sink column
            return attend_each_sequence(q, kv_cache, meta, scale, window, softcap, sinks)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        flat = KVTensorLayout.of(kv_cache).slot_rows(kv_cache)
        self._attend_short(plan, q, kv_cache, flat, out, scale)
        for start, qlen, seq_len, base in plan.chunks:
            context = _fp32(flat[:, base : base + seq_len - qlen]) if seq_len > qlen else None
            attend_chunk(start, qlen, q, k, v, context, kv_cache.dtype, out, scale)
        return out

    def _attend_short(self, plan: ContiguousStepPlan, q: torch.Tensor, kv_cache: torch.Tensor, flat: torch.Tensor,
                      out: torch.Tensor, scale: float) -> None:
        num_kv_heads, head_dim = KVTensorLayout.of(kv_cache).token_shape
        for start, _, seq_len, base in plan.short:
            kv = _fp32(flat[:, base : base + seq_len])
            # The query heads of a KV head become rows of that head: [1, kv_heads, heads_per_kv, head_dim].
            queries = q[start].view(1, num_kv_heads, -1, head_dim)
            attended = F.scaled_dot_product_attention(
                queries, kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0), scale=scale)
            out[start] = attended.reshape(-1)


class NativeContiguousAttention(ContiguousAttention):
    """Every query through the native op over consecutive tables, in one call per layer."""

    name = "contiguous-native"
    short_below = sys.maxsize  # no query is long enough for the torch chunk path
    masks = True

    def __init__(self) -> None:
        reason = native_unavailable_reason()
        if reason is not None:
            raise ValueError(f"the contiguous-native attention backend cannot run: {reason}")
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = self.start_forward(q, kv_cache, meta, window, softcap, sinks)
        torch.ops.pagedserve.write_kv_(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if plan.short:
            torch.ops.pagedserve.paged_attention_(out, q, kv_cache, meta.block_tables, meta.query_start_loc,
                                                  meta.seq_lens, plan.short_seqs, scale, window, softcap,
                                                  None if sinks is None else sinks.float().contiguous())
        return out


def _fp32(kv: torch.Tensor | None) -> torch.Tensor | None:
    """A narrow cache's rows as fp32 (a copy of just those rows); fp32 ones as they are."""
    return kv if kv is None or kv.dtype == torch.float32 else kv.float()
