"""The attention backend interface and the reference implementation.

A KV cache for one layer is laid out as core/kv_tensor_layout.py's `KVTensorLayout`
says, of float32, or of float16 / float8 when `--kv-cache-dtype` narrows it: stores
convert (saturating at the type's largest finite value, as the native write does), reads
convert back to fp32.

Two per-layer options serve Gemma 2/3 and Phi-3 (model/gemma.py): `window` > 0 lets a
query see only the keys less than `window` positions before it (a sliding-window layer;
the cache keeps every key, the window only masks), and `softcap` > 0 caps each scaled
score as softcap * tanh(score / softcap) before the softmax. Backends that have them say
so with `masks = True`; the others refuse a layer that needs them (refuse_masks).

gpt-oss adds `sinks`: one learned logit per query head [num_heads] that joins every row's
softmax denominator and has no value, so a row may give less than all its weight to the
keys. Every backend with `attention_sinks = True` takes it; the others refuse it by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, Protocol, TypeVar

import torch

from ..core.kv_tensor_layout import KVTensorLayout
from .metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    masks: bool  # takes window and softcap
    attention_sinks: bool  # takes sinks

    def prepare(self, meta: AttentionMetadata) -> object:
        """Work shared by every layer of the step `meta` describes (index building,
        grouping), done once before the forward; `forward` may rely on it."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # one layer's, as KVTensorLayout describes
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Store k/v at meta.slot_mapping, then attend over each sequence's context."""
        ...


class _StepPlan(Protocol):
    @property
    def meta(self) -> AttentionMetadata: ...


PlanT = TypeVar("PlanT", bound=_StepPlan)


class PlannedBackend(ABC, Generic[PlanT]):
    """A backend whose `prepare` builds the step's plan once per metadata object: every
    layer of the step gets that plan, and the next step's metadata makes a new one."""

    name: str
    masks: bool
    attention_sinks: bool

    def __init__(self) -> None:
        self._plan: PlanT | None = None

    def start_forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int,
                      softcap: float, sinks: torch.Tensor | None = None) -> PlanT:
        """The step's plan, once the layer's options and q have passed the checks every
        forward makes before it touches the cache."""
        if not self.masks:
            refuse_masks(self.name, window, softcap)
        if sinks is not None:
            if not self.attention_sinks:
                raise ValueError(f"the {self.name} attention backend has no attention sinks (gpt-oss); "
                                 "use the native or cpu backend")
            check_sinks(q, sinks)
        check_step(q, kv_cache, meta)
        return self.prepare(meta)

    def prepare(self, meta: AttentionMetadata) -> PlanT:
        if self._plan is None or self._plan.meta is not meta:
            self._plan = self._make_plan(meta)
        return self._plan

    @abstractmethod
    def _make_plan(self, meta: AttentionMetadata) -> PlanT: ...


def refuse_masks(backend: str, window: int, softcap: float) -> None:
    """ValueError for a backend without sliding windows or soft-capping asked for one."""
    if window or softcap:
        raise ValueError(f"the {backend} attention backend has no sliding window or logit soft-capping "
                         f"(window={window}, softcap={softcap}); use the native or cpu backend")


def check_sinks(q: torch.Tensor, sinks: torch.Tensor) -> None:
    """ValueError unless `sinks` is one logit per query head of q."""
    if not sinks.is_floating_point() or sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be a float tensor [{q.shape[1]}] (one per query head), "
                         f"got {sinks.dtype} {tuple(sinks.shape)}")


def check_step(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """ValueError unless q's heads are a multiple of the cache's KV heads and its rows
    are the step's tokens."""
    num_heads, num_kv_heads = q.shape[1], KVTensorLayout.of(kv_cache).num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads; must be a multiple of the cache's {num_kv_heads} KV heads")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows; meta.slot_mapping has {meta.num_tokens}")


# The narrow types' largest finite values: stores saturate there (torch's own
# conversion gives inf past fp16's and e5m2's).
_SATURATE = {torch.float16: 65504.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    limit = _SATURATE.get(dtype)
    return (x if limit is None else x.clamp(-limit, limit)).to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots."""
    flat = KVTensorLayout.of(kv_cache).slot_rows(kv_cache)
    k, v = to_cache_dtype(k, kv_cache.dtype), to_cache_dtype(v, kv_cache.dtype)
    if kv_cache.element_size() == 1:  # torch has no index_copy_ for fp8: move the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


class ReferenceBackend:
    """Obviously-correct attention, one sequence at a time. Used by tests as the oracle
    for faster backends; never on the hot path."""

    name = "reference"
    masks = True
    attention_sinks = True

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to share: each sequence is attended on its own."""

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            check_sinks(q, sinks)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return attend_each_sequence(q, kv_cache, meta, scale, window, softcap, sinks)


def attend_each_sequence(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every sequence's new rows over its cached context (stored already), one explicit
    score matrix at a time: the oracle, and the torch path for windows, soft-capping and sinks."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0 (0: none), got {window} and {softcap}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    layout = KVTensorLayout.of(kv_cache)
    group = num_heads // layout.num_kv_heads
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    starts = meta.query_start_loc.tolist()
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        nblocks = -(-slen // meta.block_size)
        blocks = meta.block_tables[i, :nblocks]
        keys = layout.keys(kv_cache)[blocks].reshape(-1, *layout.token_shape)[:slen].float()
        vals = layout.values(kv_cache)[blocks].reshape(-1, *layout.token_shape)[:slen].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, slen, D]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[starts[i] : starts[i] + qlen].transpose(0, 1)  # [H, qlen, D]
        scores = qs @ keys.transpose(1, 2) * scale  # [H, qlen, slen]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(slen - qlen, slen).unsqueeze(1)
        k_pos = torch.arange(slen).unsqueeze(0)
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # a column with no value: its share of each row's weight is dropped
            sink_column = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, qlen, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i] + qlen] = (probs @ vals).transpose(0, 1).reshape(qlen, -1)
    return out
