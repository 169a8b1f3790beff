"""The message rank 0 broadcasts to the other ranks: a fixed header of 8 int64s, then
(when the header says so) one flat int64 payload. No pickled objects: every field is a
count or an id, and a receiver checks the magic before trusting the counts.

Header (int64 little/native endian as torch lays it, 64 bytes):

    [0] MAGIC (format version in the low 16 bits)   [4] table_width  W
    [1] kind: RUN, COPY, SHUTDOWN, INIT             [5] num_logits   R
    [2] num_tokens  T                               [6] num_copies   C
    [3] num_seqs    S                               [7] payload_len  (int64 count)

Payload of RUN / COPY (COPY has T = S = W = R = 0):
    input_ids[T] positions[T] slot_mapping[T] query_start_loc[S+1] seq_lens[S]
    block_tables[S*W] (row-major) logits_indices[R] copy_src[C] copy_dst[C]
Payload of INIT: num_blocks, block_size, kv_cache_dtype (index in KV_CACHE_DTYPES),
    then the model's num_layers, hidden_size, vocab_size (each rank checks it loaded
    the same model).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from ..attention.metadata import AttentionMetadata
from ..core.kv_plan import KV_CACHE_DTYPES
from ..model.config import ModelConfig
from .group import TPGroup

MAGIC = 0x5053_5450_0000 | 1  # "PSTP", version 1
HEADER_LEN = 8


class Kind(IntEnum):
    RUN = 1
    COPY = 2
    SHUTDOWN = 3
    INIT = 4


@dataclass(frozen=True)
class StepTensors:
    """One forward's inputs (ModelRunner.prepare_inputs' tensors) plus a copy-on-write list."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | None
    logits_indices: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor

    @property
    def runs(self) -> bool:
        return self.meta is not None


@dataclass(frozen=True)
class InitInfo:
    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, num_blocks: int, block_size: int, kv_cache_dtype: str, config: ModelConfig) -> "InitInfo":
        return cls(num_blocks, block_size, kv_cache_dtype, config.num_layers, config.hidden_size, config.vocab_size)

    def check_model(self, config: ModelConfig) -> None:
        mine = (config.num_layers, config.hidden_size, config.vocab_size)
        theirs = (self.num_layers, self.hidden_size, self.vocab_size)
        if mine != theirs:
            raise ValueError(f"this rank loaded a model with (layers, hidden, vocab) {mine}, rank 0 {theirs}: "
                             "every rank must load the same model")


def _header(kind: Kind, t=0, s=0, w=0, r=0, c=0, payload_len=0) -> torch.Tensor:
    return torch.tensor([MAGIC, kind, t, s, w, r, c, payload_len], dtype=torch.int64)


def send(group: TPGroup, header: torch.Tensor, payload: torch.Tensor | None = None) -> None:
    group.broadcast(header, idle=True)
    if payload is not None and payload.numel():
        group.broadcast(payload)


def send_step(group: TPGroup, step: StepTensors) -> None:
    meta = step.meta
    c = int(step.copy_src.numel())
    if meta is None:
        payload = torch.cat([step.copy_src, step.copy_dst]).to(torch.int64)
        send(group, _header(Kind.COPY, c=c, payload_len=payload.numel()), payload)
        return
    s, w = meta.block_tables.shape
    payload = torch.cat([
        step.input_ids, step.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
        meta.block_tables.reshape(-1), step.logits_indices, step.copy_src, step.copy_dst,
    ]).to(torch.int64)
    send(group, _header(Kind.RUN, int(step.input_ids.numel()), s, w, int(step.logits_indices.numel()), c,
                        payload.numel()), payload)


def send_init(group: TPGroup, info: InitInfo) -> None:
    payload = torch.tensor([info.num_blocks, info.block_size, KV_CACHE_DTYPES.index(info.kv_cache_dtype),
                            info.num_layers, info.hidden_size, info.vocab_size], dtype=torch.int64)
    send(group, _header(Kind.INIT, payload_len=payload.numel()), payload)


def send_shutdown(group: TPGroup) -> None:
    send(group, _header(Kind.SHUTDOWN))


def receive(group: TPGroup, block_size: int = 0) -> tuple[Kind, StepTensors | InitInfo | None]:
    """The next message (a worker's side of send_*). `block_size` builds RUN's metadata."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    group.broadcast(header, idle=True)
    magic, kind, t, s, w, r, c, n = header.tolist()
    if magic != MAGIC or kind not in Kind._value2member_map_ or min(t, s, w, r, c, n) < 0:
        raise ValueError(f"not a pagedserve step header (or another version): {header.tolist()}")
    kind = Kind(kind)
    expected = {Kind.RUN: 3 * t + 2 * s + 1 + s * w + r + 2 * c, Kind.COPY: 2 * c, Kind.SHUTDOWN: 0,
                Kind.INIT: 6}[kind]
    if n != expected:
        raise ValueError(f"step header's payload length {n} does not match its counts ({expected})")
    payload = torch.empty(n, dtype=torch.int64)
    if n:
        group.broadcast(payload)
    if kind == Kind.SHUTDOWN:
        return kind, None
    if kind == Kind.INIT:
        nb, bs, dt, layers, hidden, vocab = payload.tolist()
        return kind, InitInfo(nb, bs, KV_CACHE_DTYPES[dt], layers, hidden, vocab)
    sizes = [t, t, t, s + 1, s, s * w, r, c, c] if kind == Kind.RUN else [0, 0, 0, 0, 0, 0, 0, c, c]
    ids, pos, slots, qsl, seq_lens, tables, logits_idx, src, dst = payload.split(sizes)
    meta = None
    if kind == Kind.RUN:
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables.view(s, w), slot_mapping=slots,
            query_lens_cpu=qsl.diff().tolist(), seq_lens_cpu=seq_lens.tolist(), block_size=block_size)
    return kind, StepTensors(ids, pos, meta, logits_idx, src, dst)
