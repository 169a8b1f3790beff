"""What every attention backend needs to know about one step's flattened batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def slot_mapping(block_tables, rows, positions, block_size: int):
    """The cache slot of each token: block_tables[rows[i]] holds the blocks of token i's
    sequence and positions[i] its position. numpy arrays or torch tensors alike."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class AttentionMetadata:
    """One step: `num_seqs` sequences whose new tokens are laid end to end.

    Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of q/k/v; those
    tokens sit at positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1, and
    each attends causally to every earlier position of its own sequence (the
    earlier ones are already in the KV cache, addressed through its block table).

    Frozen: a backend plans a step once per metadata object (see `prepare`), so a
    step's metadata must never be edited into another step's.
    """

    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor  # int64 [num_seqs]: context length after this step
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    # The same lengths as Python ints: backends branch on them without a sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @classmethod
    def for_sequences(
        cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
    ) -> "AttentionMetadata":
        """Build from plain lists: sequence i computes its last query_lens[i] positions
        of seq_lens[i], with blocks block_tables[i]. For tests and benchmarks; the model
        runner builds the same tensors from its persistent arrays."""
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        tables = tables.view(len(block_tables), width)
        rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens, dtype=torch.int64))
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]) if query_lens else rows
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int64).cumsum(0)
        return cls(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=tables,
            slot_mapping=slot_mapping(tables, rows, positions, block_size),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

