"""The fast CPU backend against the per-sequence reference, on shuffled block tables."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.attention.backend import ReferenceBackend
from pagedserve.attention.cpu_backend import PREFILL_MIN_QUERY_LEN, CpuPagedAttention, partition_by_length
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.selector import backend_names, get_backend
from pagedserve.attention.testing import random_step
from pagedserve.attention.timed import TimedBackend

HEAD_DIM = 8
LONG = PREFILL_MIN_QUERY_LEN + 5  # a query long enough to take the prefill path


def make_step(seqs, num_heads: int = 6, num_kv_heads: int = 2, block_size: int = 4, seed: int = 0):
    return random_step(seqs, num_heads, num_kv_heads, HEAD_DIM, block_size, seed)


def assert_matches_reference(seqs, num_heads=6, num_kv_heads=2, block_size=4, seed=0):
    q, k, v, cache, meta = make_step(seqs, num_heads, num_kv_heads, block_size, seed)
    scale = 1 / math.sqrt(HEAD_DIM)
    expected_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, expected_cache, meta, scale)
    got = CpuPagedAttention().forward(q, k, v, cache, meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, expected_cache)


HEADS = pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3), (4, 1)], ids=["mha", "gqa2", "gqa3", "mqa"]
)


@HEADS
def test_decode_batch_with_lengths_on_and_off_block_boundaries(num_heads, num_kv_heads):
    seqs = [(1, n) for n in (1, 3, 4, 8, 9, 16, 17, 31, 40)]
    assert_matches_reference(seqs, num_heads, num_kv_heads)


@HEADS
def test_prefill_without_context(num_heads, num_kv_heads):
    assert_matches_reference([(LONG, LONG)], num_heads, num_kv_heads)
    assert_matches_reference([(32, 32)], num_heads, num_kv_heads)  # ends on a block boundary


@HEADS
def test_prefill_chunk_after_earlier_context(num_heads, num_kv_heads):
    assert_matches_reference([(LONG, LONG + 13)], num_heads, num_kv_heads)
    assert_matches_reference([(LONG, LONG + 1)], num_heads, num_kv_heads)
    assert_matches_reference([(24, 24 + 40)], num_heads, num_kv_heads)  # context and chunk block-aligned


def test_short_prompts_batch_with_decodes():
    # Below PREFILL_MIN_QUERY_LEN a whole prompt rides in a decode group, padded and masked.
    assert_matches_reference([(5, 5), (1, 30), (3, 3), (1, 2)])


@HEADS
def test_mixed_step_of_decodes_and_prefill_chunks(num_heads, num_kv_heads):
    seqs = [(1, 12), (LONG, LONG + 9), (1, 57), (1, 3), (LONG + 3, LONG + 3), (1, 16)]
    assert_matches_reference(seqs, num_heads, num_kv_heads)


@HEADS
def test_speculative_verification_queries(num_heads, num_kv_heads):
    seqs = [(2, 9), (5, 40), (3, 3), (4, 17), (1, 20), (5, 16)]
    assert_matches_reference(seqs, num_heads, num_kv_heads)


def test_realistic_shape_with_block_size_16():
    seqs = [(1, 70), (1, 300), (3, 129), (40, 140), (1, 16)]
    assert_matches_reference(seqs, num_heads=9, num_kv_heads=3, block_size=16)


def test_sequences_without_new_tokens_are_skipped():
    q, k, v, cache, meta = make_step([(1, 5), (0, 9), (2, 7)])
    # The reference cannot take an empty query; give it the step without that sequence.
    keep = [0, 2]
    reduced = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 3]),
        seq_lens=meta.seq_lens[keep],
        block_tables=meta.block_tables[keep],
        slot_mapping=meta.slot_mapping,
        query_lens_cpu=[1, 2],
        seq_lens_cpu=[5, 7],
        block_size=meta.block_size,
    )
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), reduced, 0.3)
    torch.testing.assert_close(CpuPagedAttention().forward(q, k, v, cache, meta, 0.3), expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 2 * PREFILL_MIN_QUERY_LEN), st.integers(0, 50)).map(lambda t: (t[0], t[0] + t[1])),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([(4, 4), (6, 2), (9, 3)]),
    st.sampled_from([4, 16]),
    st.integers(0, 2**16),
)
def test_random_steps_match_reference(seqs, heads, block_size, seed):
    assert_matches_reference(seqs, *heads, block_size=block_size, seed=seed)


def test_write_kv_puts_each_new_row_in_its_slot():
    q, k, v, cache, meta = make_step([(1, 7), (LONG, LONG + 6), (3, 12)])
    untouched = cache.clone()
    CpuPagedAttention().forward(q, k, v, cache, meta, 0.3)
    rows = cache.view(2, -1, *cache.shape[-2:])
    assert torch.equal(rows[0, meta.slot_mapping], k)
    assert torch.equal(rows[1, meta.slot_mapping], v)
    others = torch.ones(rows.shape[1], dtype=torch.bool)
    others[meta.slot_mapping] = False
    assert torch.equal(rows[:, others], untouched.view_as(rows)[:, others])


def test_plan_is_reused_across_layers_and_rebuilt_for_a_new_step():
    backend = CpuPagedAttention()
    seqs = [(1, 10), (LONG, LONG + 5), (2, 7)]
    for seed in (1, 2):  # two steps, each with its own metadata
        _, _, _, _, meta = make_step(seqs, seed=seed)
        plan = backend.prepare(meta)
        for layer in range(3):  # each layer: its own cache and activations, the step's metadata
            q, k, v, cache, _ = make_step(seqs, seed=seed * 10 + layer)
            expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, 0.35)
            got = backend.forward(q, k, v, cache, meta, 0.35)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert backend.prepare(meta) is plan


def test_step_metadata_cannot_be_edited_into_another_step():
    _, _, _, _, meta = make_step([(1, 10), (2, 7)], seed=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.seq_lens_cpu = [11, 8]


def test_timed_backend_adds_up_the_seconds_of_the_backend_it_wraps():
    timed = TimedBackend(CpuPagedAttention())
    q, k, v, cache, meta = make_step([(1, 10), (LONG, LONG + 5)], seed=3)
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, 0.35)
    timed.prepare(meta)
    torch.testing.assert_close(timed.forward(q, k, v, cache, meta, 0.35), expected, rtol=1e-5, atol=1e-5)
    assert timed.name == "cpu" and timed.seconds > 0


def test_backend_works_in_and_out_of_inference_mode():
    backend = CpuPagedAttention()
    q, k, v, cache, meta = make_step([(1, 9), (LONG, LONG + 3)])
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, 0.3)
    with torch.inference_mode():
        inside = backend.forward(q, k, v, cache.clone(), meta, 0.3)
    torch.testing.assert_close(inside, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backend.forward(q, k, v, cache, meta, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_partition_keeps_one_long_context_away_from_many_short_ones():
    seqs = [(1, 2000)] + [(1, 64 + 2 * i) for i in range(31)]
    _, _, _, _, meta = make_step(seqs, block_size=16)
    groups = partition_by_length(meta, list(range(len(seqs))))
    assert [0] in groups
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))


def test_partition_puts_equal_lengths_in_one_group():
    _, _, _, _, meta = make_step([(1, 500)] * 20 + [(1, 497)] * 4, block_size=16)
    assert partition_by_length(meta, list(range(24))) == [list(range(24))]


def test_heads_not_a_multiple_of_kv_heads_is_rejected():
    q, k, v, cache, meta = make_step([(1, 5)], num_heads=4, num_kv_heads=4)
    with pytest.raises(ValueError, match="multiple"):
        CpuPagedAttention().forward(q[:, :3], k, v, cache, meta, 0.3)


def test_selector_defaults_to_the_cpu_backend_and_names_the_choices():
    assert isinstance(get_backend(None), CpuPagedAttention)
    assert isinstance(get_backend("reference"), ReferenceBackend)
    names = ["contiguous", "contiguous-native", "cpu", "native", "reference", "triton"]
    assert backend_names() == names
    # config checks these names without importing the backends (torch-free for the simulator).
    from pagedserve.attention.contiguous_backend import ContiguousAttention, NativeContiguousAttention
    from pagedserve.core.contiguous_kv import CONTIGUOUS_BACKENDS
    assert set(CONTIGUOUS_BACKENDS) == {ContiguousAttention.name, NativeContiguousAttention.name}
    with pytest.raises(ValueError, match=re.escape(str(names))):
        get_backend("flash")
