"""The sharded model's parallel pieces, swapped into a LlamaModel built from a rank's
local config (sharding.TPShard.local_config): its qkv and gate_up are already the
column-parallel shards, so only the layers that need a collective are wrapped."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.llama import LlamaModel
from .group import TPGroup
from .sharding import TPShard


class RowParallel(nn.Module):
    """o / down: this rank's columns of the weight times its slice of the input, then
    one all-reduce sums the partial outputs."""

    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding: ids outside them look up zeros, and the
    all-reduce fills every row from the one rank that holds it (so the sum is exact)."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, group: TPGroup):
        super().__init__()
        self.weight, self.start, self.count, self.group = weight, start, stop - start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.count)
        rows = F.embedding(local.clamp(0, max(self.count - 1, 0)), self.weight)
        return self.group.all_reduce(rows * mine.unsqueeze(-1))


class GatheredHead(nn.Module):
    """The LM head's vocabulary shard; rank 0 gathers the full [R, vocab] logits (the
    padding columns of a vocabulary that does not divide dropped), other ranks get their
    own shard back and ignore it."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: TPGroup):
        super().__init__()
        self.inner, self.vocab_size, self.group = inner, vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.gather_last_dim(self.inner(x))
        return logits[..., : self.vocab_size] if self.group.rank == 0 else logits


def parallelize(model: LlamaModel, shard: TPShard, group: TPGroup) -> LlamaModel:
    """Wrap a loaded shard's o, down, embedding and head with their collectives."""
    for layer in model.layers:
        layer.o = RowParallel(layer.o, group)
        layer.down = RowParallel(layer.down, group)
    model.embed = VocabParallelEmbedding(model.embed.weight, *shard.vocab, group)
    model.lm_head = GatheredHead(model.lm_head, shard.config.vocab_size, group)
    return model
