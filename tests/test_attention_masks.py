"""Sliding windows and logit soft-capping (Gemma 2/3, Phi-3, Mistral) in the native
paged-attention op and the torch backends, against the per-sequence reference."""
from __future__ import annotations

import pytest
import torch

from kernel_paths import outputs_on_every_path
from pagedserve.attention.backend import ReferenceBackend, attend_each_sequence, write_kv
from pagedserve.attention.contiguous_backend import ContiguousAttention
from pagedserve.attention.cpu_backend import CpuPagedAttention
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.attention.testing import random_step
from pagedserve.kernels import native_unavailable_reason

# Decodes below, inside and far past the window (a 1,000-key context: whole 256-key
# partitions before the window are skipped), short causal queries, and prefill chunks.
SEQS = [(1, n) for n in (1, 17, 300, 1000)] + [(5, 40), (40, 300), (300, 300)]
OPTIONS = pytest.mark.parametrize("window,softcap", [(0, 0.7), (100, 0.0), (37, 1.5), (256, 0.0)],
                                  ids=["softcap", "window100", "window37-softcap", "window256"])


@pytest.fixture(scope="module", autouse=True)
def native_library():
    assert native_unavailable_reason() is None


def native_op(q, cache, meta, scale, window, softcap) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2])
    torch.ops.pagedserve.paged_attention_(out, q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                          torch.arange(meta.num_seqs), scale, window, softcap)
    return out


@OPTIONS
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)], ids=["gqa3", "gqa4-d128"])
def test_native_op_matches_the_reference(window, softcap, num_heads, num_kv_heads, head_dim):
    q, k, v, cache, meta = random_step(SEQS, num_heads, num_kv_heads, head_dim, 16, seed=3)
    write_kv(k, v, cache, meta.slot_mapping)
    scale = head_dim**-0.5
    expected = attend_each_sequence(q, cache, meta, scale, window, softcap)
    # Soft-capping's tanh is the op's own (exp-based); the rest is summation order.
    torch.testing.assert_close(native_op(q, cache, meta, scale, window, softcap), expected, rtol=1e-5, atol=1e-5)
    if window:  # the window changed the rows that reach past it
        assert not torch.allclose(attend_each_sequence(q, cache, meta, scale, 0, softcap), expected, atol=1e-3)


@OPTIONS
def test_every_instruction_set_path_gives_the_same_bits(window, softcap):
    q, k, v, cache, meta = random_step(SEQS, 9, 3, 64, 16, seed=4)
    write_kv(k, v, cache, meta.slot_mapping)
    outputs = outputs_on_every_path(lambda _: native_op(q, cache, meta, 0.125, window, softcap), q, [q.shape[0]])
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def prompt_in_chunks(backend, chunks: list[int], q, k, v, window: int, softcap: float) -> torch.Tensor:
    """One prompt's attention output, its tokens fed in `chunks` (one step each)."""
    table = list(range(-(-q.shape[0] // 16)))
    cache = torch.zeros(2, len(table) + 2, 16, k.shape[1], k.shape[2])
    outs, pos = [], 0
    for n in chunks:
        meta = AttentionMetadata.for_sequences([n], [pos + n], [table], 16)
        rows = slice(pos, pos + n)
        outs.append(backend.forward(q[rows], k[rows], v[rows], cache, meta, 0.125, window, softcap))
        pos += n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [37, 300])
def test_a_prompts_bits_do_not_depend_on_its_chunking(window):
    # Skipping the partitions before a tile's window must not change a row's sum: the
    # same prompt whole, in chunks across partition edges, and token by token at the end.
    torch.manual_seed(0)
    n = 600
    q, k, v = torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64)
    whole = prompt_in_chunks(NativePagedAttention(), [n], q, k, v, window, 0.9)
    for chunks in ([256, 44, 300], [100, 1, 15, 184, 290, 10], [590] + [1] * 10):
        assert torch.equal(prompt_in_chunks(NativePagedAttention(), chunks, q, k, v, window, 0.9), whole), chunks


def test_torch_backend_and_reference_agree_and_cache_writes_match():
    q, k, v, cache, meta = random_step(SEQS, 9, 3, 64, 16, seed=5)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    expected = ReferenceBackend().forward(q, k, v, ref_cache, meta, 0.125, 50, 0.8)
    got = CpuPagedAttention().forward(q, k, v, cpu_cache, meta, 0.125, 50, 0.8)
    native = NativePagedAttention().forward(q, k, v, cache, meta, 0.125, 50, 0.8)
    assert torch.equal(got, expected) and torch.equal(cpu_cache, ref_cache) and torch.equal(cache, ref_cache)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


def test_backends_without_masks_refuse_them_and_bad_options_are_errors():
    q, k, v, cache, meta = random_step([(1, 20)], 4, 2, 64, 16)
    assert not ContiguousAttention.masks
    with pytest.raises(ValueError, match="no sliding window or logit soft-capping"):
        ContiguousAttention().forward(q, k, v, cache, meta, 0.125, 16, 0.0)
    with pytest.raises(ValueError, match="window and softcap must be >= 0"):
        ReferenceBackend().forward(q, k, v, cache, meta, 0.125, -1, 0.0)
    with pytest.raises(RuntimeError, match="window and softcap must be >= 0"):
        native_op(q, cache, meta, 0.125, 0, -2.0)
