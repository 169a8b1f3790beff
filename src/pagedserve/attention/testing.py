"""Random attention steps for the backend tests and benchmarks."""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def random_step(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                seed: int = 0, spare_blocks: int = 3):
    """q/k/v for the new tokens, a cache full of random earlier K/V, and metadata whose
    block tables hand out the blocks of a shuffled pool (never contiguous runs);
    `seqs` holds (query_len, seq_len) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks  # blocks nobody owns
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for nblocks in blocks_per_seq:
        tables.append(pool[:nblocks])
        pool = pool[nblocks:]
    num_tokens = sum(q for q, _ in seqs)
    meta = AttentionMetadata.for_sequences([q for q, _ in seqs], [s for _, s in seqs], tables, block_size)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return q, k, v, cache, meta
