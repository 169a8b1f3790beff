"""Which rows or columns of each weight a tensor-parallel rank holds (vLLM's split).

Column-parallel (output rows split): q/k/v by heads, gate/up by intermediate rows, the
embedding and the LM head by vocabulary rows. Row-parallel (input columns split): o by
query heads, down by intermediate columns; their partial outputs are summed across ranks.
With fewer KV heads than ranks each KV head is replicated on the ranks whose query
heads read it. Everything else (norms, RoPE divisors) is replicated.

The rules are stated once, on Hugging Face names (`hf_slice`); the fused tensors of a
converted cache are cut by splitting them back into those parts (`shard_fused_state`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..model.config import ModelConfig


@dataclass(frozen=True)
class Cut:
    """Keep [start, stop) along `dim`, zero-padded to `padded` entries (a vocabulary
    that does not divide by the rank count: every rank's head must be equally wide)."""

    dim: int
    start: int
    stop: int
    padded: int

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        start, stop = (min(x, t.shape[self.dim]) for x in (self.start, self.stop))
        return self.pad(t.narrow(self.dim, start, stop - start))

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        """The cut part (already read as such) padded, as a tensor of its own."""
        if part.shape[self.dim] < self.padded:
            pad = list(part.shape)
            pad[self.dim] = self.padded - part.shape[self.dim]
            part = torch.cat([part, part.new_zeros(pad)], dim=self.dim)
        # A copy, always: a narrowed view would keep the whole tensor (or its mapping) alive.
        return part.float().contiguous().clone()


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size` on the full model `config`."""

    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.config, self.size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside tensor_parallel_size {n}")
        if c.num_heads % n:
            raise ValueError(f"tensor_parallel_size ({n}) must divide the model's {c.num_heads} attention heads")
        if c.moe is not None:
            raise ValueError("tensor parallelism does not split a mixture of experts (model/moe.py) yet; "
                             "serve this model with tensor_parallel_size 1")
        if c.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size ({n}) must divide the model's intermediate size "
                             f"({c.intermediate_size})")
        kv = c.num_kv_heads
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise ValueError(f"tensor_parallel_size ({n}) and the model's {kv} KV heads must divide one another "
                             "(KV heads are split, or replicated when there are fewer than ranks)")

    @property
    def q_heads(self) -> tuple[int, int]:
        per = self.config.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    @property
    def kv_heads(self) -> tuple[int, int]:
        kv, n = self.config.num_kv_heads, self.size
        if kv >= n:
            per = kv // n
            return self.rank * per, (self.rank + 1) * per
        # Replicated: the one KV head that this rank's query heads attend with.
        head = self.rank * kv // n
        return head, head + 1

    @property
    def ffn(self) -> tuple[int, int]:
        per = self.config.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """This rank's token ids [start, stop) (the last ranks' may be fewer than vocab_per_rank, or none)."""
        v = self.config.vocab_size
        start = min(self.rank * self.vocab_per_rank, v)
        return start, min(start + self.vocab_per_rank, v)

    def local_config(self) -> ModelConfig:
        """The config a rank builds its LlamaModel from: its heads, FFN and vocabulary share."""
        c = self.config
        return dataclasses.replace(
            c, num_heads=c.num_heads // self.size, num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=c.intermediate_size // self.size, vocab_size=self.vocab_per_rank)

    def _rows(self, span: tuple[int, int], unit: int, dim: int = 0) -> Cut:
        return Cut(dim, span[0] * unit, span[1] * unit, (span[1] - span[0]) * unit)

    def hf_slice(self, name: str) -> Cut | None:
        """The cut of the HF tensor `name` this rank keeps; None: replicated."""
        d = self.config.head_dim
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return self._rows(self.q_heads, d)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return self._rows(self.kv_heads, d)
        if name.endswith("o_proj.weight"):
            return self._rows(self.q_heads, d, dim=1)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return self._rows(self.ffn, 1)
        if name.endswith("down_proj.weight"):
            return self._rows(self.ffn, 1, dim=1)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = self.rank * self.vocab_per_rank
            return Cut(0, start, start + self.vocab_per_rank, self.vocab_per_rank)
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            raise ValueError(f"{name}: a row-parallel layer with a bias is not supported under tensor parallelism")
        return None

    def shard_hf(self, name: str, t: torch.Tensor) -> torch.Tensor:
        cut = self.hf_slice(name)
        return t if cut is None else cut.apply(t)

    def shard_fused_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A fused state dict (model/weights.py names) cut to this rank, tensor by tensor."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        out = {}
        for name, t in state.items():
            _, _, leaf = name.rpartition(".")
            if name.endswith(("qkv.weight", "qkv.bias")):
                parts = zip(t.split([q, kv, kv]), ("q_proj", "k_proj", "v_proj"))
                out[name] = torch.cat([self.shard_hf(f"{p}.{leaf}", x) for x, p in parts])
            elif name.endswith("gate_up.weight"):
                out[name] = torch.cat([self.shard_hf("gate_proj.weight", x) for x in t.chunk(2)])
            elif name.endswith(".o.weight"):
                out[name] = self.shard_hf("o_proj.weight", t)
            elif name.endswith(".down.weight"):
                out[name] = self.shard_hf("down_proj.weight", t)
            elif name in ("embed.weight", "lm_head.weight"):
                out[name] = self.shard_hf("lm_head.weight", t)
            else:
                out[name] = t.clone()
        return out
