"""The native paged-attention and cache-write ops, and the backend built on them,
against the per-sequence reference."""
from __future__ import annotations

import random

import pytest
import torch

from kernel_paths import outputs_on_every_path
from pagedserve.attention.backend import ReferenceBackend, to_cache_dtype, write_kv
from pagedserve.attention.cpu_backend import PREFILL_MIN_QUERY_LEN, CpuPagedAttention
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.attention.selector import default_backend_name, get_backend
from pagedserve.attention.testing import random_step
from pagedserve.kernels import native_unavailable_reason


@pytest.fixture(scope="module", autouse=True)
def native_library():
    # Not a skip: a broken build must fail these tests, not hide them.
    assert native_unavailable_reason() is None


def reference(q, k, v, cache, meta, scale) -> torch.Tensor:
    return ReferenceBackend().forward(q, k, v, cache.clone(), meta, scale)


def native_op(q, cache, meta, scale, seqs=None) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2])
    ids = torch.arange(meta.num_seqs) if seqs is None else torch.tensor(seqs, dtype=torch.int64)
    torch.ops.pagedserve.paged_attention_(
        out, q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, ids, scale
    )
    return out


def assert_op_matches(seqs, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    q, k, v, cache, meta = random_step(seqs, num_heads, num_kv_heads, head_dim, block_size, seed)
    scale = head_dim**-0.5
    expected = reference(q, k, v, cache, meta, scale)
    write_kv(k, v, cache, meta.slot_mapping)
    torch.testing.assert_close(native_op(q, cache, meta, scale), expected, rtol=1e-5, atol=2e-6)


def assert_backend_matches(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=0, meta=None):
    q, k, v, cache, random_meta = random_step(seqs, num_heads, num_kv_heads, head_dim, block_size, seed)
    meta = meta or random_meta
    scale = head_dim**-0.5
    expected_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, expected_cache, meta, scale)
    got = NativePagedAttention().forward(q, k, v, cache, meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    assert torch.equal(cache, expected_cache)


HEADS = pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (16, 2)], ids=["gqa1", "gqa3", "gqa4", "gqa8"]
)


@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_on_and_off_block_boundaries(num_heads, num_kv_heads, head_dim, block_size):
    lengths = (1, 2, 15, 16, 17, 31, 32, 33, 65, 513)
    assert_op_matches([(1, n) for n in lengths], num_heads, num_kv_heads, head_dim, block_size)


@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
def test_short_queries_are_causal_within_their_new_tokens(num_heads, num_kv_heads, head_dim):
    # Verification rows and prompts below PREFILL_MIN_QUERY_LEN, some wholly new, some
    # ending on, just after or just before a block boundary.
    seqs = [(2, 9), (5, 40), (3, 3), (15, 15), (4, 17), (PREFILL_MIN_QUERY_LEN - 1, 48), (7, 33), (1, 1)]
    assert_op_matches(seqs, num_heads, num_kv_heads, head_dim, 16)


@pytest.mark.parametrize("threads", [1, 2, 5], indirect=True)
@pytest.mark.parametrize("seq_len", [1, 255, 256, 257, 300, 1000, 4096])
def test_one_sequence_split_across_threads(threads, seq_len):
    # Fewer sequences than work slots: the context is cut into partitions and merged,
    # including partitions that end inside a block and one a causal row cannot see.
    assert_op_matches([(1, seq_len)], 9, 3, 64, 16)
    if seq_len >= 5:
        assert_op_matches([(5, seq_len)], 9, 3, 64, 16)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_many_sequences_of_uneven_lengths(threads):
    rnd = random.Random(1)
    seqs = [(rnd.choice([1, 1, 1, 3, 5]), rnd.randint(5, 2100)) for _ in range(12)]
    assert_op_matches(seqs, 9, 3, 64, 16, seed=3)


def test_a_rows_output_does_not_depend_on_the_batch_threads_or_chunking():
    # Bitwise: the engine's "same tokens alone and in a busy batch" rests on this. The
    # same cached keys are read by a decode, by the last row of a 5-token chunk, alone,
    # beside other sequences, and on 1, 2 and 5 threads.
    torch.manual_seed(0)
    block_size, seq_len = 16, 1000
    cache = torch.randn(2, 80, block_size, 3, 64)
    table = torch.randperm(80)[: -(-seq_len // block_size)].tolist()
    others = [(1, 37, [1, 2, 3]), (3, 600, list(range(40, 78))), (1, 9, [5])]
    q_last = torch.randn(1, 9, 64)

    def last_row(query_len, with_others, threads):
        lens = [query_len] + ([n for n, _, _ in others] if with_others else [])
        seq_lens = [seq_len] + ([s for _, s, _ in others] if with_others else [])
        tables = [table] + ([t for _, _, t in others] if with_others else [])
        meta = AttentionMetadata.for_sequences(lens, seq_lens, tables, block_size)
        q = torch.randn(sum(lens), 9, 64)
        q[query_len - 1] = q_last[0]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return native_op(q, cache, meta, 0.125)[query_len - 1]
        finally:
            torch.set_num_threads(before)

    expected = last_row(1, False, 1)
    for query_len in (1, 5):
        for with_others in (False, True):
            for threads in (1, 2, 5):
                assert torch.equal(last_row(query_len, with_others, threads), expected), (query_len, with_others, threads)


CACHE_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=["fp32", "fp16", "fp8_e4m3", "fp8_e5m2"])


def prompt_in_chunks(backend, chunks, others, q, k, v, dtype, block_size=16):
    """One prompt's attention output, its tokens fed in `chunks` (one step each) with
    `others` (query_len, seq_len) sequences beside it in every step, into a fresh cache."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], k.shape[2]
    table = list(range(-(-q.shape[0] // block_size)))
    cache = torch.zeros(2, len(table) + 40, block_size, kv_heads, head_dim).to(dtype)
    other_tables = [list(range(len(table) + 10 * i, len(table) + 10 * (i + 1))) for i in range(len(others))]
    outs, pos = [], 0
    for n in chunks:
        lens = [n] + [ql for ql, _ in others]
        rows = sum(lens)
        meta = AttentionMetadata.for_sequences(lens, [pos + n] + [sl for _, sl in others],
                                               [table] + other_tables, block_size)
        pad = lambda x: torch.cat([x[pos:pos + n], torch.randn(rows - n, *x.shape[1:], generator=gen)])  # noqa: E731
        outs.append(backend.forward(pad(q), pad(k), pad(v), cache, meta, head_dim**-0.5)[:n])
        pos += n
    return torch.cat(outs)


@CACHE_DTYPES
@pytest.mark.parametrize("backend", ["native", "contiguous-native"])
def test_a_prompts_bits_do_not_depend_on_its_chunking_or_the_batch(dtype, backend):
    # The engine's "same tokens alone and in a busy batch" rests on this, prefill included:
    # a prompt chunked differently (its own budget, or beside other requests' decodes and
    # chunks) must store the same K/V in the next layer. Long chunks once went through
    # torch's flash attention, which blocks keys by the chunk's length: other bits per
    # chunking, which an fp8_e4m3 cache turned into other greedy tokens on AMD Zen 4.
    from pagedserve.attention.contiguous_backend import NativeContiguousAttention

    make = {"native": NativePagedAttention, "contiguous-native": NativeContiguousAttention}[backend]
    torch.manual_seed(0)
    n = 300  # more than one 256-key partition, and more rows than one tile
    q, k, v = torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64)
    whole = prompt_in_chunks(make(), [n], [], q, k, v, dtype)
    for chunks, others in (([256, 44], []), ([24] * 12 + [12], [(1, 37)]), ([100, 1, 15, 184], [(1, 9), (20, 20)]),
                           ([16] * 18 + [1] * 12, [])):
        got = prompt_in_chunks(make(), chunks, others, q, k, v, dtype)
        assert torch.equal(got, whole), (chunks, others)


@CACHE_DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 72)],
                         ids=["gqa1", "gqa3", "gqa4-d128", "gqa8-d72"])
def test_every_instruction_set_path_gives_the_same_bits(dtype, num_heads, num_kv_heads, head_dim):
    # The AVX-512 path takes three query rows of a KV head through each K/V vector, the
    # AVX2 path one; a narrow cache is widened in registers (GQA <= 3 decodes) or through
    # the per-block buffer (longer queries, GQA 4 and 8). Decodes, short causal queries
    # whose rows see different keys, a split sequence, and prefill chunks whose keys the
    # AVX-512 path transposes (8+ rows per KV head), on 1 and 2 threads.
    seqs = [(1, n) for n in (1, 7, 16, 17, 300)] + [(2, 9), (4, 17), (5, 40), (1, 1000), (40, 300), (19, 19)]
    q, k, v, cache, meta = random_step(seqs, num_heads, num_kv_heads, head_dim, 16, seed=5)
    write_kv(k, v, cache, meta.slot_mapping)
    cache = to_cache_dtype(cache, dtype)
    outputs = outputs_on_every_path(lambda _: native_op(q, cache, meta, head_dim**-0.5), q, [q.shape[0]])
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_only_the_chosen_sequences_are_written():
    q, k, v, cache, meta = random_step([(1, 30), (20, 50), (2, 9)], 9, 3, 64, 16)
    expected = reference(q, k, v, cache, meta, 0.125)
    write_kv(k, v, cache, meta.slot_mapping)
    got = native_op(q, cache, meta, 0.125, seqs=[2, 0])
    rows = [0, 21, 22]
    torch.testing.assert_close(got[rows], expected[rows], rtol=1e-5, atol=2e-6)
    assert not got[1:21].any()


def test_blocks_shared_between_sequences():
    # A prefix-cached prompt: three sequences read the same first blocks; one has a
    # private copy of the last shared block (copy-on-write), in any order in the pool.
    block_size = 16
    shared = [7, 2, 9]
    tables = [shared + [4], shared + [0, 5], shared[:2] + [8], [3, 1]]
    seqs = [(1, 60), (3, 80), (2, 40), (1, 20)]
    q, k, v, cache, _ = random_step([(1, 16 * 10)], 9, 3, 64, block_size)
    num_tokens = sum(n for n, _ in seqs)
    q, k, v = torch.randn(num_tokens, 9, 64), torch.randn(num_tokens, 3, 64), torch.randn(num_tokens, 3, 64)
    meta = AttentionMetadata.for_sequences([n for n, _ in seqs], [s for _, s in seqs], tables, block_size)
    expected = reference(q, k, v, cache, meta, 0.125)
    got = NativePagedAttention().forward(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_backend_on_a_mixed_step(threads):
    # Decodes, verification rows, small chunks and long chunks with and without context.
    long = PREFILL_MIN_QUERY_LEN + 5
    seqs = [(1, 12), (long, long + 9), (4, 57), (1, 3), (long + 3, long + 3), (9, 16), (300, 700), (1, 1500)]
    assert_backend_matches(seqs)
    assert_backend_matches(seqs, num_heads=8, num_kv_heads=1, head_dim=128, block_size=32, seed=1)


def test_backend_skips_sequences_without_new_tokens():
    q, k, v, cache, meta = random_step([(1, 5), (0, 9), (2, 7)], 9, 3, 64, 16)
    got = NativePagedAttention().forward(q, k, v, cache.clone(), meta, 0.3)
    expected = CpuPagedAttention().forward(q, k, v, cache, meta, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_backend_works_in_and_out_of_inference_mode():
    backend = NativePagedAttention()
    q, k, v, cache, meta = random_step([(1, 9), (PREFILL_MIN_QUERY_LEN + 2, 40)], 9, 3, 64, 16)
    expected = reference(q, k, v, cache, meta, 0.3)
    with torch.inference_mode():
        inside = backend.forward(q, k, v, cache.clone(), meta, 0.3)
    torch.testing.assert_close(inside, expected, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(backend.forward(q, k, v, cache, meta, 0.3), expected, rtol=1e-5, atol=2e-6)


def test_write_kv_op_matches_index_copy_from_strided_views():
    _, _, _, cache, meta = random_step([(1, 7), (20, 26), (3, 12)], 9, 3, 64, 16)
    # k and v as the model hands them over: column slices of one fused qkv row.
    qkv = torch.randn(meta.num_tokens, (9 + 3 + 3) * 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(-1, 3, 64)
    v = qkv[:, 12 * 64 :].view(-1, 3, 64)
    expected = cache.clone()
    write_kv(k, v, expected, meta.slot_mapping)
    torch.ops.pagedserve.write_kv_(cache, k, v, meta.slot_mapping)
    assert torch.equal(cache, expected)


def test_write_kv_op_rejects_slots_outside_the_cache():
    _, k, v, cache, meta = random_step([(2, 4)], 9, 3, 64, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedserve.write_kv_(cache, k, v, meta.slot_mapping + cache.shape[1] * 16)


def test_selector_picks_native_for_native_kernels():
    assert default_backend_name("native") == "native"
    assert default_backend_name("torch") == "cpu"
    assert isinstance(get_backend("native"), NativePagedAttention)


@pytest.mark.slow
@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_long_contexts_sweep(num_heads, num_kv_heads, head_dim, block_size, threads):
    rnd = random.Random(num_heads * head_dim + block_size)
    seqs = [(rnd.choice([1, 2, 4, 15]), rnd.randint(16, 4096)) for _ in range(12)] + [(1, 4096)]
    assert_op_matches(seqs, num_heads, num_kv_heads, head_dim, block_size, seed=block_size)
    assert_backend_matches(seqs + [(200, 3000)], num_heads, num_kv_heads, head_dim, block_size)


@pytest.fixture(scope="module")
def loaded():
    from pagedserve.model.loader import load_model

    return load_model()


def test_engine_greedy_tokens_equal_on_both_kernel_paths_alone_and_in_a_busy_batch(loaded):
    from engine_utils import busy_batch_bits, busy_batch_tokens, make_llm
    from pagedserve import SamplingParams

    tokens = {}
    for kernels, backend in (("native", "native"), ("torch", "cpu")):
        # Small chunks: a prompt is cut differently alone and beside the others.
        llm = make_llm(loaded, kernels=kernels, max_num_batched_tokens=24, max_num_seqs=8)
        assert llm.engine.runner.backend.name == backend
        if kernels == "native":  # the logits' bits too
            tokens[kernels] = busy_batch_bits(llm)
        else:
            tokens[kernels] = busy_batch_tokens(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert tokens["native"] == tokens["torch"]


def test_explicit_attention_backend_wins_over_the_kernel_default(loaded):
    from engine_utils import make_llm

    assert make_llm(loaded, kernels="native", attention_backend="cpu").engine.runner.backend.name == "cpu"
    assert make_llm(loaded, kernels="torch", attention_backend="native").engine.runner.backend.name == "native"
