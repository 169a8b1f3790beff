"""Random attention steps for the backend tests and benchmarks."""
from __future__ import annotations

import torch

from ..core.kv_tensor_layout import KVTensorLayout
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
    cache = torch.randn(KVTensorLayout(num_blocks, block_size, num_kv_heads, head_dim, torch.float32).shape,
                        generator=gen)
    return q, k, v, cache, meta


# Steps for device_check: (label, (query_len, seq_len) per sequence, heads, KV heads,
# head_dim, block_size). A decode of few sequences (split-KV), one of many (not split),
# and a mixed step with prefill chunks over cached contexts.
DEVICE_CHECK_STEPS = [
    ("decode-split", [(1, n) for n in (1, 17, 300, 1025, 4096)], 9, 3, 64, 16),
    ("decode-wide", [(1, 40 + 37 * i) for i in range(64)], 32, 8, 128, 16),
    ("mixed", [(1, 12), (20, 20), (7, 40), (1, 3), (70, 100), (150, 900), (1, 2000)], 32, 8, 128, 32),
]
# How far an attention backend may stray from the fp32 reference over the same stored
# K/V: fp32 activations only by summation order; bf16 ones by bf16's 8-bit mantissa.
DEVICE_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def device_check(backend, device: str, steps=DEVICE_CHECK_STEPS,
                 kv_dtypes=(torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)) -> list[dict]:
    """`backend` on `device` against ReferenceBackend on the CPU, for every step x
    activation dtype x cache dtype: the largest output error, whether it is within
    DEVICE_CHECK_TOLERANCE, and whether both wrote the same cache bytes."""
    from .backend import ReferenceBackend

    results = []
    for label, seqs, heads, kv_heads, head_dim, block_size in steps:
        q, k, v, cache, meta = random_step(seqs, heads, kv_heads, head_dim, block_size)
        on_device = AttentionMetadata(**{
            f: getattr(meta, f).to(device) if isinstance(getattr(meta, f), torch.Tensor) else getattr(meta, f)
            for f in meta.__dataclass_fields__
        })
        for act in DEVICE_CHECK_TOLERANCE:
            qa, ka, va = (t.to(act) for t in (q, k, v))
            for kv_dtype in kv_dtypes:
                stored = cache.to(kv_dtype)
                expected_cache = stored.clone()
                expected = ReferenceBackend().forward(qa.float(), ka.float(), va.float(), expected_cache, meta,
                                                      head_dim**-0.5)
                device_cache = stored.to(device)
                got = backend.forward(qa.to(device), ka.to(device), va.to(device), device_cache, on_device,
                                      head_dim**-0.5)
                error = (got.float().cpu() - expected).abs().max().item()
                same_bytes = torch.equal(device_cache.cpu().view(torch.uint8), expected_cache.view(torch.uint8))
                results.append({"step": label, "activations": str(act).removeprefix("torch."),
                                "kv_cache": str(kv_dtype).removeprefix("torch."), "max_abs_error": error,
                                "within_tolerance": error <= DEVICE_CHECK_TOLERANCE[act],
                                "cache_bytes_equal": same_bytes})
    return results


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
