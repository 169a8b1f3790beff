"""KV-cache sizing and the contiguous-vs-paged waste exercise, with the arithmetic shown."""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from ..core.scheduler_config import DEFAULT_BLOCK_SIZE
from ..core.validation import require_int

GB, GIB = 10**9, 2**30


@dataclass(frozen=True, slots=True)
class KVSize:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    tokens: int
    bytes_per_token: int
    bytes_per_sequence: int
    memory_bytes: int | None
    tokens_that_fit: int | None
    sequences_that_fit: int | None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gb_per_sequence"] = self.bytes_per_sequence / GB
        d["gib_per_sequence"] = self.bytes_per_sequence / GIB
        return d

    def explain(self) -> str:
        lines = [
            "KV bytes per token = num_layers x 2 (K and V) x num_kv_heads x head_dim x bytes",
            f"                   = {self.num_layers} x 2 x {self.num_kv_heads} x {self.head_dim} x {self.dtype_bytes}"
            f" = {self.bytes_per_token:,} B ({self.bytes_per_token / 2**10:.1f} KiB)",
            f"per sequence of {self.tokens:,} tokens = {self.bytes_per_sequence:,} B"
            f" = {self.bytes_per_sequence / GB:.3f} GB = {self.bytes_per_sequence / GIB:.3f} GiB",
        ]
        if self.memory_bytes is not None:
            lines.append(f"{self.memory_bytes:,} B hold {self.tokens_that_fit:,} tokens"
                         f" = {self.sequences_that_fit:,} sequences of {self.tokens:,} tokens")
        return "\n".join(lines)


def kv_size(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, tokens: int,
            memory_bytes: int | None = None) -> KVSize:
    for name, v in (("layers", num_layers), ("kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("dtype_bytes", dtype_bytes), ("tokens", tokens)):
        require_int(name, v, 1)
    per_token = num_layers * 2 * num_kv_heads * head_dim * dtype_bytes
    fit = None if memory_bytes is None else memory_bytes // per_token
    return KVSize(num_layers, num_kv_heads, head_dim, dtype_bytes, tokens, per_token, per_token * tokens,
                  memory_bytes, fit, None if fit is None else fit // tokens)


@dataclass(frozen=True, slots=True)
class WasteResult:
    num_requests: int
    max_len: int
    block_size: int
    used_tokens: int
    contiguous_reserved: int
    paged_reserved: int
    # (c) demand-paged contiguous regions (vAttention): each layer's K and V commit pages of
    # page_size bytes, stream_bytes per token; in token slots (a float: pages are not whole tokens).
    stream_bytes: int = 768
    page_size: int = 4096
    demand_paged_reserved: float = 0.0

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.used_tokens / self.contiguous_reserved

    @property
    def paged_waste(self) -> float:
        return 1 - self.used_tokens / self.paged_reserved

    @property
    def demand_paged_waste(self) -> float:
        return 1 - self.used_tokens / self.demand_paged_reserved

    @property
    def tokens_per_page(self) -> float:
        return self.page_size / self.stream_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(contiguous_waste=self.contiguous_waste, paged_waste=self.paged_waste,
                 demand_paged_waste=self.demand_paged_waste, tokens_per_page=self.tokens_per_page,
                 mean_len=self.used_tokens / self.num_requests)
        return d

    def explain(self) -> str:
        n, used = self.num_requests, self.used_tokens
        return "\n".join([
            f"{n} requests use {used:,} token slots in all (mean {used / n:,.1f})",
            f"(a) contiguous: reserve max_len per request = {n} x {self.max_len:,} = {self.contiguous_reserved:,} slots",
            f"    waste = 1 - {used:,} / {self.contiguous_reserved:,} = {100 * self.contiguous_waste:.2f}%",
            f"(b) paged: reserve ceil(len / {self.block_size}) blocks of {self.block_size} per request"
            f" = {self.paged_reserved:,} slots",
            f"    waste = 1 - {used:,} / {self.paged_reserved:,} = {100 * self.paged_waste:.2f}%"
            f"  (expected about (block_size - 1) / 2 / mean_len = {100 * (self.block_size - 1) / 2 / (used / n):.2f}%)",
            f"(c) demand-paged contiguous: each layer's K and V commit {self.page_size:,} B pages as tokens arrive;"
            f" a page holds {self.page_size:,} / {self.stream_bytes:,} = {self.tokens_per_page:.2f} tokens of one"
            f" stream = {self.demand_paged_reserved:,.0f} slots",
            f"    waste = 1 - {used:,} / {self.demand_paged_reserved:,.0f} = {100 * self.demand_paged_waste:.2f}%"
            f"  ({'finer' if self.tokens_per_page < self.block_size else 'coarser'} than {self.block_size}-token blocks)",
        ])


def waste(num_requests: int, mean: float, std: float, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE,
          seed: int = 0, stream_bytes: int = 768, page_size: int = 4096) -> WasteResult:
    """Lengths ~ Normal(mean, std) rounded and clipped to [1, max_len]; each request's slots are
    reserved whole (contiguous), in blocks as its tokens arrive (paged), or in pages of each
    layer's K and V as they arrive (demand-paged contiguous; stream_bytes: one token of one
    layer's K, 768 for SmolLM2 in fp32)."""
    for name, v in (("requests", num_requests), ("max_len", max_len), ("block_size", block_size),
                    ("stream_bytes", stream_bytes), ("page_size", page_size)):
        require_int(name, v, 1)
    if not 0 < mean <= max_len or std < 0:
        raise ValueError(f"mean must be in (0, max_len={max_len}] and std >= 0; got mean={mean}, std={std}")
    rng = random.Random(seed)
    lengths = [min(max_len, max(1, round(rng.gauss(mean, std)))) for _ in range(num_requests)]
    paged = sum(math.ceil(x / block_size) * block_size for x in lengths)
    demand = sum(-(-x * stream_bytes // page_size) for x in lengths) * page_size / stream_bytes
    return WasteResult(num_requests, max_len, block_size, sum(lengths), num_requests * max_len, paged,
                       stream_bytes, page_size, demand)
