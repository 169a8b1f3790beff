"""Paged attention on Triton kernels (attention/triton_kernels.py; docs/gpu-kernels.md).

Two launches per layer, whatever the step holds: the fused KV write puts the step's
K/V into their slots, then one paged-attention kernel serves decodes and prefill
chunks alike, reading every sequence's K/V (its own new rows included, as stored)
through its block table in place. Nothing in `forward` reads a device value on the
host, so a decode step can be captured in a CUDA graph. On CPU tensors the kernels
run only in triton's interpreter (TRITON_INTERPRET=1 before they are first imported):
that is how the tests check them.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..core.kv_tensor_layout import KVTensorLayout
from .backend import PlannedBackend
from .backend_names import TRITON_BACKEND
from .metadata import AttentionMetadata


def triton_unavailable_reason() -> str | None:
    """Why this backend cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton, or the 'test' extra)"
    return None


@dataclass(frozen=True, slots=True)
class TritonStepPlan:
    meta: AttentionMetadata
    max_query_len: int  # 1 for a decode-only step: the kernel then takes its smallest tile


class TritonPagedAttention(PlannedBackend[TritonStepPlan]):
    """`decode_segments`: how many parts a decode step of few sequences cuts each
    context into (split-KV, so that such a step still fills the GPU); a power of two."""

    name = TRITON_BACKEND
    masks = False
    attention_sinks = False  # refused by start_forward: its kernel has no sink column

    def __init__(self, decode_segments: int | None = None) -> None:
        reason = triton_unavailable_reason()
        if reason is not None:
            raise ValueError(f"the triton attention backend cannot run: {reason}")
        from . import triton_kernels  # imports triton: only once it is known to be there

        segments = triton_kernels.DECODE_SEGMENTS if decode_segments is None else decode_segments
        if segments < 1 or segments & (segments - 1):
            raise ValueError(f"decode_segments must be a power of two >= 1, got {decode_segments}")
        self._kernels = triton_kernels
        self._decode_segments = segments
        super().__init__()

    def _make_plan(self, meta: AttentionMetadata) -> TritonStepPlan:
        return TritonStepPlan(meta, meta.max_query_len)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = self.start_forward(q, kv_cache, meta, window, softcap, sinks)
        self._check_inputs(q, k, v, kv_cache, meta)
        segments = self._kernels.num_segments(meta.num_seqs, KVTensorLayout.of(kv_cache).num_kv_heads,
                                              plan.max_query_len,
                                              self._decode_segments)
        self._kernels.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        self._kernels.paged_attention(
            out, q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, plan.max_query_len,
            segments,
        )
        return out

    def _check_inputs(self, q, k, v, kv_cache, meta: AttentionMetadata) -> None:
        """ValueError for what the kernels cannot address: they index the innermost
        dimension as contiguous and the block offset with a power-of-two range."""
        if q.device.type == "cpu" and not self._kernels.INTERPRETED:
            raise ValueError("the triton backend runs on CPU tensors only in triton's interpreter: "
                             "set TRITON_INTERPRET=1 before pagedserve.attention.triton_kernels is imported")
        if kv_cache.dtype not in self._kernels.CACHE_DTYPES:
            raise ValueError(f"kv_cache dtype must be one of {self._kernels.CACHE_DTYPES}, got {kv_cache.dtype}")
        block_size = KVTensorLayout.of(kv_cache).block_size
        if block_size != meta.block_size or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16 and match the cache's {block_size}, "
                             f"got {meta.block_size}")
        for name, t in (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            t = getattr(meta, name)
            if t.device != q.device:
                raise ValueError(f"meta.{name} is on {t.device}, q on {q.device}")
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"meta.{name} must be int32 or int64, got {t.dtype}")
