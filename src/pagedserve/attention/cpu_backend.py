"""Fast paged attention on CPU, built on torch's flash-attention CPU kernel.

A step is split by query length:

- short queries (decodes, speculative verification, tiny chunks) are batched:
  sequences of similar context length share one scaled_dot_product_attention
  call over K/V gathered from their block tables and padded to the group's
  longest context;
- a long prefill chunk is attended alone: causally over its own new K/V (read
  straight from k/v, no gather), plus, when there is earlier context, unmasked
  over the gathered context, the two halves merged by their log-sum-exp.

benchmarks/attention_backends.py measures this design against the alternatives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..core.kv_tensor_layout import KVTensorLayout
from .backend import PlannedBackend, attend_each_sequence, to_cache_dtype, write_kv
from .metadata import AttentionMetadata

# From this many query tokens on, a sequence gets its own call: the causal kernel
# then skips the masked half of the chunk, and padding short queries up to its
# length would multiply their work.
PREFILL_MIN_QUERY_LEN = 16
# The cost model that groups short queries by context length, in units of one
# sequence's key position: a call's fixed cost (~0.1 ms on one core) is worth about
# this many of them (~0.25-0.5 us each) ...
GROUP_CALL_COST = 256
# ... and a query of up to this many tokens costs one pass over the keys, as
# the kernel takes that many rows (x query heads per KV head) in one tile.
QUERY_TOKENS_PER_PASS = 8

# Unlike the public SDPA it also returns the log-sum-exp, which merging the two
# halves of a prefill chunk needs; it reads K/V with fewer heads than Q (GQA) in place.
_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class ShortQueryGroup:
    """Sequences attended in one call, padded to the longest context and query."""

    block_ids: torch.Tensor  # [num_seqs * num_blocks]: each sequence's blocks, in order
    num_seqs: int
    num_blocks: int
    query_len: int
    q_rows: torch.Tensor  # [num_seqs * query_len]: q row of each padded query (pads repeat a real one)
    real_rows: torch.Tensor | None  # padded positions that hold real queries; None when all do
    out_rows: torch.Tensor  # the token rows those real queries are
    masked: torch.Tensor | None  # [num_seqs, 1, query_len, keys] bool; None when nothing is masked
    biases: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def bias_for(self, heads_per_kv: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask (0 or -inf) with one row per (query token, query head of a
        KV head); built for the first layer, reused by the rest. An additive mask of the
        query's dtype is what the kernel consumes; a boolean one is converted per call."""
        if self.masked is None:
            return None
        key = (heads_per_kv, dtype)
        if key not in self.biases:
            # A single query row broadcasts over the folded heads; longer queries repeat each row.
            rows = self.masked if self.query_len == 1 else self.masked.repeat_interleave(heads_per_kv, dim=2)
            self.biases[key] = torch.zeros(rows.shape, dtype=dtype).masked_fill_(rows, float("-inf"))
        return self.biases[key]


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's long query: rows start:start+query_len, after context_len cached tokens."""

    start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # the blocks holding the earlier context


@dataclass(slots=True)
class StepPlan:
    """Everything derived from one step's metadata, shared by all layers."""

    meta: AttentionMetadata
    groups: list[ShortQueryGroup]
    prefills: list[PrefillChunk]
    max_gathered_blocks: int


class CpuPagedAttention(PlannedBackend[StepPlan]):
    """The default CPU backend.

    `prepare(meta)` builds the step's grouping, gather indices and masks once; every
    layer's `forward` given the same metadata object reuses them. The first forward of
    a step calls it if the caller has not (tests and benchmarks call `forward` alone).
    The plan is keyed by the metadata object, which is frozen, so a plan can never
    outlive the step it was built for.

    Gathered K/V land in a workspace kept between calls and layers: a fresh tensor of
    that size per call costs page faults that outweigh the copy itself (the 200 MB
    gather of 64 x 2,048-token decodes: ~24 ms into the workspace, ~170 ms into a
    new tensor).
    """

    name = "cpu"
    # A sliding-window, soft-capped or sink layer takes the explicit per-sequence path
    # (backend.attend_each_sequence): torch's flash kernel has none of these options.
    masks = True
    attention_sinks = True

    def __init__(self) -> None:
        super().__init__()
        self._workspace = torch.empty(0)

    def _make_plan(self, meta: AttentionMetadata) -> StepPlan:
        return build_plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = self.start_forward(q, kv_cache, meta, window, softcap, sinks)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if window or softcap or sinks is not None:
            return attend_each_sequence(q, kv_cache, meta, scale, window, softcap, sinks)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        workspace = self._workspace_for(kv_cache, plan.max_gathered_blocks)
        for group in plan.groups:
            _attend_group(group, q, kv_cache, workspace, out, scale)
        for chunk in plan.prefills:
            attend_prefill(chunk, q, k, v, kv_cache, workspace, out, scale)
        return out

    def _workspace_for(self, kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        self._workspace = workspace_for(self._workspace, kv_cache, num_blocks)
        return self._workspace


def workspace_for(workspace: torch.Tensor, kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A flat buffer for the K/V of `num_blocks` blocks: `workspace` while it is big enough."""
    numel = math.prod(KVTensorLayout.of(kv_cache).blocks_shape(num_blocks))
    if (
        workspace.numel() < numel
        or workspace.dtype != kv_cache.dtype
        # One made under inference_mode cannot be written outside it.
        or workspace.is_inference() != torch.is_inference_mode_enabled()
    ):
        return torch.empty(numel, dtype=kv_cache.dtype)
    return workspace


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """Those blocks' K/V, in order and in the cache's layout, copied into the front of the
    workspace; as fp32 (a copy) when the cache is narrower."""
    shape = KVTensorLayout.of(kv_cache).blocks_shape(block_ids.numel())
    buf = workspace[: math.prod(shape)].view(shape)
    torch.index_select(kv_cache, 1, block_ids, out=buf)
    return buf if buf.dtype == torch.float32 else buf.float()


def _attend_group(
    group: ShortQueryGroup,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    n, qlen = group.num_seqs, group.query_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    layout = KVTensorLayout.of(kv_cache)
    num_kv_heads = layout.num_kv_heads
    heads_per_kv = num_heads // num_kv_heads
    keys_len = group.num_blocks * layout.block_size
    kv = _gather(kv_cache, group.block_ids, workspace).view(2, n, keys_len, num_kv_heads, head_dim)
    # The query heads that share a KV head become extra query rows of that head, so
    # each K/V row is read once per KV head and GQA needs no expanded copy of K/V.
    queries = (
        q.index_select(0, group.q_rows)
        .view(n, qlen, num_kv_heads, heads_per_kv, head_dim)
        .transpose(1, 2)
        .reshape(n, num_kv_heads, qlen * heads_per_kv, head_dim)
    )
    attended = F.scaled_dot_product_attention(
        queries,
        layout.keys(kv).transpose(1, 2),  # [n, num_kv_heads, keys, head_dim], a strided view the kernel reads in place
        layout.values(kv).transpose(1, 2),
        attn_mask=group.bias_for(heads_per_kv, q.dtype),
        scale=scale,
    )
    rows = (
        attended.view(n, num_kv_heads, qlen, heads_per_kv, head_dim)
        .transpose(1, 2)
        .reshape(n * qlen, num_heads * head_dim)
    )
    if group.real_rows is not None:
        rows = rows.index_select(0, group.real_rows)
    out.index_copy_(0, group.out_rows, rows)


def attend_prefill(
    chunk: PrefillChunk,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    context = None
    if chunk.context_len:
        kv = _gather(kv_cache, chunk.block_ids, workspace)
        context = KVTensorLayout.of(kv_cache).slot_rows(kv)[:, : chunk.context_len]
    attend_chunk(chunk.start, chunk.query_len, q, k, v, context, kv_cache.dtype, out, scale)


def attend_chunk(
    start: int,
    query_len: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: torch.Tensor | None,  # [2, context_len, num_kv_heads, head_dim] fp32: the earlier K/V
    cache_dtype: torch.dtype,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Rows start:start+query_len of one sequence: causal over their own K/V, merged with
    the earlier context (wherever it was read from) by log-sum-exp."""
    rows = slice(start, start + query_len)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    # Causal over the chunk itself, whose K/V are this step's k/v: nothing to gather,
    # and the kernel skips the masked half. A narrow cache's chunk attends its own K/V
    # as stored (rounded), as every later step will read them. (Still not bit-invariant to
    # the chunking: flash attention blocks its keys by the chunk's length. The native
    # backend is; attention/native_backend.py.)
    own_k, own_v = k[rows], v[rows]
    if cache_dtype != own_k.dtype:
        own_k = to_cache_dtype(own_k, cache_dtype).to(own_k.dtype)
        own_v = to_cache_dtype(own_v, cache_dtype).to(own_v.dtype)
    attended, lse = _flash_attention(
        queries, own_k.transpose(0, 1).unsqueeze(0), own_v.transpose(0, 1).unsqueeze(0), 0.0, True, scale=scale
    )
    if context is not None:
        # Every query sees all of the earlier context, so no mask, and the query heads of
        # a KV head can share one pass over its keys: [1, num_kv_heads, heads_per_kv * query_len, head_dim].
        folded = queries.reshape(1, num_kv_heads, -1, head_dim)
        earlier, earlier_lse = _flash_attention(
            folded, context[0].transpose(0, 1).unsqueeze(0), context[1].transpose(0, 1).unsqueeze(0), 0.0, False,
            scale=scale,
        )
        weight, earlier_weight = _merge_weights(lse, earlier_lse.reshape(lse.shape))
        attended = attended * weight.unsqueeze(-1) + earlier.reshape(attended.shape) * earlier_weight.unsqueeze(-1)
    out[rows] = attended[0].transpose(0, 1).reshape(query_len, num_heads * head_dim)


def _merge_weights(a_lse: torch.Tensor, b_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over two disjoint key sets is each set's normalised output
    weighted by its share of the total probability mass: those two shares, from each
    set's log-sum-exp."""
    total = torch.logaddexp(a_lse, b_lse)
    return (a_lse - total).exp_(), (b_lse - total).exp_()


def build_plan(meta: AttentionMetadata) -> StepPlan:
    """Split the step into short-query groups and prefill chunks, with their indices."""
    short, prefills = split_step(meta)
    groups = [_short_group(meta, members) for members in partition_by_length(meta, short)]
    return StepPlan(meta, groups, prefills, max_gathered_blocks(groups, prefills))


def max_gathered_blocks(groups: list[ShortQueryGroup], prefills: list[PrefillChunk]) -> int:
    return max([g.block_ids.numel() for g in groups] + [c.block_ids.numel() for c in prefills], default=0)


def split_step(meta: AttentionMetadata) -> tuple[list[int], list[PrefillChunk]]:
    """The sequences with short queries (by index), and the long ones as prefill chunks;
    sequences without new tokens are in neither."""
    starts = meta.query_start_loc.tolist()
    short: list[int] = []
    prefills: list[PrefillChunk] = []
    for i, (qlen, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if qlen > seq_len:
            raise ValueError(f"sequence {i}: query_len {qlen} exceeds seq_len {seq_len}")
        if qlen == 0:
            continue
        if qlen < PREFILL_MIN_QUERY_LEN:
            short.append(i)
            continue
        context_len = seq_len - qlen
        num_blocks = -(-context_len // meta.block_size)
        prefills.append(PrefillChunk(starts[i], qlen, context_len, meta.block_tables[i, :num_blocks]))
    return short, prefills


def partition_by_length(meta: AttentionMetadata, seqs: list[int]) -> list[list[int]]:
    """Group sequences so that padding to each group's longest costs the least.

    Sequences sorted by padded context length (longest first) are cut into runs by
    dynamic programming; a run costs GROUP_CALL_COST plus its padded work: members x
    longest context x passes for its longest query. Sequences of equal padded length
    move as one item, so the search is quadratic in the number of distinct lengths.
    """
    bs = meta.block_size
    buckets: dict[int, list[int]] = {}
    for i in seqs:
        buckets.setdefault(-(-meta.seq_lens_cpu[i] // bs) * bs, []).append(i)
    lengths = sorted(buckets, reverse=True)
    members = [buckets[n] for n in lengths]
    sizes = [len(m) for m in members]
    passes = [-(-max(meta.query_lens_cpu[i] for i in m) // QUERY_TOKENS_PER_PASS) for m in members]
    best = [0] + [math.inf] * len(lengths)
    cut = [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        count = run_passes = 0
        for start in range(end - 1, -1, -1):  # the run is items start..end-1; lengths[start] is its longest
            count += sizes[start]
            run_passes = max(run_passes, passes[start])
            work = GROUP_CALL_COST + count * lengths[start] * run_passes
            if work >= best[end]:
                break  # reaching further back only adds members, length and passes
            if best[start] + work < best[end]:
                best[end], cut[end] = best[start] + work, start
    runs: list[list[int]] = []
    end = len(lengths)
    while end:
        runs.append([i for item in members[cut[end] : end] for i in item])
        end = cut[end]
    return runs


def _short_group(meta: AttentionMetadata, seqs: list[int]) -> ShortQueryGroup:
    index = torch.tensor(seqs)
    qlens = torch.tensor([meta.query_lens_cpu[i] for i in seqs]).unsqueeze(1)
    seq_lens = torch.tensor([meta.seq_lens_cpu[i] for i in seqs]).unsqueeze(1)
    max_q = max(meta.query_lens_cpu[i] for i in seqs)
    num_blocks = -(-max(meta.seq_lens_cpu[i] for i in seqs) // meta.block_size)
    keys_len = num_blocks * meta.block_size

    offsets = torch.arange(max_q).unsqueeze(0)
    real = offsets < qlens  # [n, max_q]
    rows = meta.query_start_loc[index].unsqueeze(1) + torch.minimum(offsets, qlens - 1)
    # A padded query row sits past the end of its sequence, so it may see the whole
    # context: no row is entirely masked (which would make its softmax NaN).
    last_key = torch.minimum(seq_lens - qlens + offsets, seq_lens - 1)
    masked = (torch.arange(keys_len).view(1, 1, -1) > last_key.unsqueeze(-1)).unsqueeze(1)

    all_real = bool(real.all())
    return ShortQueryGroup(
        block_ids=meta.block_tables[index, :num_blocks].reshape(-1),
        num_seqs=len(seqs),
        num_blocks=num_blocks,
        query_len=max_q,
        q_rows=rows.reshape(-1),
        real_rows=None if all_real else real.reshape(-1).nonzero().squeeze(1),
        out_rows=rows[real],
        masked=masked if bool(masked.any()) else None,
    )
