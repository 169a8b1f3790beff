"""Random attention steps for the backend tests and benchmarks."""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def random_step(
    seqs: list[tuple[int, int]],  # (query_len, seq_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    spare_blocks: int = 3,
):
    """q/k/v for the new tokens, a cache full of random earlier K/V, and metadata whose
    block tables hand out the blocks of a shuffled pool (never contiguous runs)."""
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


def contiguous_step(
    seqs: list[tuple[int, int]],  # (query_len, seq_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    region_tokens: int,
    seed: int = 0,
):
    """As random_step, but laid out as the contiguous KV layout lays a cache out: each
    sequence owns a region of region_tokens consecutive slots (regions shuffled, two spare),
    and its table lists that region's blocks in order."""
    gen = torch.Generator().manual_seed(seed)
    per_region = region_tokens // block_size
    num_regions = len(seqs) + 2
    regions = torch.randperm(num_regions, generator=gen)[: len(seqs)].tolist()
    tables = [[r * per_region + b for b in range(-(-s // block_size))] for r, (_, s) in zip(regions, seqs)]
    meta = AttentionMetadata.for_sequences([q for q, _ in seqs], [s for _, s in seqs], tables, block_size)
    num_tokens = sum(q for q, _ in seqs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, num_regions * per_region, block_size, num_kv_heads, head_dim, generator=gen)
    return q, k, v, cache, meta
