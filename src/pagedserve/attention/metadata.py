"""What every attention backend needs to know about one step's flattened batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step: `num_seqs` sequences whose new tokens are laid end to end.

    Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of q/k/v; those
    tokens sit at positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1, and
    each attends causally to every earlier position of its own sequence (the
    earlier ones are already in the KV cache, addressed through its block table).
    """

    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor  # int64 [num_seqs]: context length after this step
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    # The same lengths as Python ints: backends branch on them without a sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
