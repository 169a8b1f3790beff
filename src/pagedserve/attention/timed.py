"""An attention backend that adds up the seconds of the one it wraps: how the digital
twin measures attention inside real engine steps without touching the hot path."""
from __future__ import annotations

import time

import torch

from .backend import AttentionBackend
from .metadata import AttentionMetadata


class TimedBackend:
    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.name = inner.name
        self.masks = inner.masks
        self.attention_sinks = inner.attention_sinks
        self.seconds = 0.0

    def prepare(self, meta: AttentionMetadata) -> None:
        self.inner.prepare(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner.forward(q, k, v, kv_cache, meta, scale, window, softcap, sinks)
        self.seconds += time.perf_counter() - t0
        return out
