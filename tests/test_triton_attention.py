"""The Triton kernels and TritonPagedAttention, run by triton's interpreter on CPU tensors,
against the per-sequence reference. Triton is in the test extra: a missing install fails
here, it is not skipped."""
from __future__ import annotations

import contextlib
import os
import random
import sys

import pytest
import torch

from pagedserve.attention.backend import ReferenceBackend, to_cache_dtype, write_kv
from pagedserve.attention.cpu_backend import CpuPagedAttention
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.selector import get_backend
from pagedserve.attention.testing import device_check, random_step
from pagedserve.attention.triton_backend import TritonPagedAttention, triton_unavailable_reason


@contextlib.contextmanager
def triton_interpreter():
    """TRITON_INTERPRET=1 within, as it was after. Triton reads the switch when it
    decorates the kernels (their first import) and again as it launches them, so it is
    set for that import and for this module's tests alone: no other test runs under it."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


with triton_interpreter():
    from pagedserve.attention import triton_kernels

KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HEADS = pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (16, 2)], ids=["gqa1", "gqa3", "gqa4", "gqa8"]
)
# Mixed steps: decodes, chunks that start a prompt, chunks over a cached context, a
# chunk longer than one program's query block (BLOCK_Q is 64 // group, so with GQA;
# the slow sweep has longer ones), ends on and around block boundaries.
MIXED = [(1, 12), (20, 20), (7, 40), (1, 3), (30, 50), (1, 33), (2, 32)]


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    assert triton_unavailable_reason() is None
    # Compiled kernels (imported before the switch was set) cannot take CPU tensors.
    assert triton_kernels.INTERPRETED
    with triton_interpreter():
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_backend_matches(seqs, num_heads, num_kv_heads, head_dim, block_size, kv_dtype=torch.float32,
                           seed=0, meta=None, decode_segments=2):
    """The backend's output and cache bytes against the reference's, from one random step.
    Decode steps are split in two by default (the interpreter pays for every program;
    test_split_kv_decode_for_any_number_of_segments covers the default count)."""
    q, k, v, cache, random_meta = random_step(seqs, num_heads, num_kv_heads, head_dim, block_size, seed)
    meta = meta or random_meta
    cache = cache.to(kv_dtype)  # a cache as stored: the earlier positions already narrowed
    expected_cache = cache.clone()
    scale = head_dim**-0.5
    expected = ReferenceBackend().forward(q, k, v, expected_cache, meta, scale)
    got = TritonPagedAttention(decode_segments).forward(q, k, v, cache, meta, scale)
    # Both read the same stored values as fp32; only the order of the sums differs.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    assert torch.equal(bits(cache), bits(expected_cache))


@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_on_and_off_block_boundaries(num_heads, num_kv_heads, head_dim, block_size):
    lengths = (1, 2, 15, 16, 17, 31, 32, 33, 65)
    assert_backend_matches([(1, n) for n in lengths], num_heads, num_kv_heads, head_dim, block_size)


@pytest.mark.parametrize("segments", [1, 2, 16])
def test_split_kv_decode_for_any_number_of_segments(segments):
    # 16 segments (the default) leave most of the short contexts' segments empty.
    assert_backend_matches([(1, 1), (1, 17), (1, 100), (1, 16)], 9, 3, 64, 16, decode_segments=segments)


def test_only_decode_steps_of_few_sequences_are_split():
    assert triton_kernels.num_segments(4, 3, 1, 16) == 16
    assert triton_kernels.num_segments(64, 2, 1, 16) == 1  # 128 programs already fill an H200
    assert triton_kernels.num_segments(4, 3, 2, 16) == 1  # a prefill or verification step
    with pytest.raises(ValueError, match="decode_segments"):
        TritonPagedAttention(decode_segments=3)


@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_chunks_over_a_cached_context_with_decodes(num_heads, num_kv_heads, head_dim):
    assert_backend_matches(MIXED, num_heads, num_kv_heads, head_dim, 16)


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
@pytest.mark.parametrize("block_size", [16, 32])
def test_narrow_kv_caches_on_a_mixed_step(kv_dtype, block_size):
    assert_backend_matches(MIXED, 9, 3, 64, block_size, KV_DTYPES[kv_dtype], seed=2)


def test_blocks_shared_between_sequences():
    # A prefix-cached prompt: sequences read the same first blocks, one with a private
    # copy of the last shared block (copy-on-write), in any order in the pool.
    block_size = 16
    shared = [7, 2, 9]
    tables = [shared + [4], shared + [0, 5], shared[:2] + [8], [3, 1]]
    seqs = [(1, 60), (3, 80), (20, 40), (1, 20)]
    meta = AttentionMetadata.for_sequences([n for n, _ in seqs], [s for _, s in seqs], tables, block_size)
    num_tokens = sum(n for n, _ in seqs)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(num_tokens, h, 64, generator=gen) for h in (9, 3, 3))
    cache = torch.randn(2, 10, block_size, 3, 64, generator=gen)
    expected_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, expected_cache, meta, 0.125)
    got = TritonPagedAttention().forward(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    assert torch.equal(cache, expected_cache)


def test_unwritten_slots_never_reach_the_output():
    # The tail of each last block is memory nobody wrote: NaN there must not leak in.
    q, k, v, cache, meta = random_step([(1, 17), (5, 21), (1, 40)], 9, 3, 64, 16)
    for table, seq_len in zip(meta.block_tables, meta.seq_lens_cpu):
        last = table[(seq_len - 1) // 16]
        cache[:, last, seq_len % 16 or 16:] = float("nan")
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, 0.125)
    got = TritonPagedAttention().forward(q, k, v, cache, meta, 0.125)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_sequences_without_new_tokens_and_int32_metadata():
    q, k, v, cache, meta = random_step([(1, 5), (0, 9), (3, 7), (0, 16)], 9, 3, 64, 16)
    expected = CpuPagedAttention().forward(q, k, v, cache.clone(), meta, 0.3)
    narrow = AttentionMetadata(
        query_start_loc=meta.query_start_loc.int(), seq_lens=meta.seq_lens.int(),
        block_tables=meta.block_tables.int(), slot_mapping=meta.slot_mapping.int(),
        query_lens_cpu=meta.query_lens_cpu, seq_lens_cpu=meta.seq_lens_cpu, block_size=16,
    )
    for m in (meta, narrow):
        got = TritonPagedAttention().forward(q, k, v, cache.clone(), m, 0.3)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_bf16_queries_against_the_fp32_reference():
    # The GPU's dtype: bf16 loads, stores and (on a GPU, not in the interpreter) dot operands.
    q, k, v, cache, meta = random_step(MIXED, 8, 2, 64, 16, seed=4)
    cache = cache.to(torch.bfloat16)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    expected = ReferenceBackend().forward(q.float(), k.float(), v.float(), cache.clone(), meta, 0.125)
    got = TritonPagedAttention().forward(q, k, v, cache, meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def special_values() -> torch.Tensor:
    """Values that exercise every branch of a narrowing store: ties at each target's
    last mantissa bit, subnormals of each, values past each range, zeros, infinities."""
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=gen) * torch.logspace(-9, 6, 4096)
    ties = []
    for man_bits in (10, 7, 3, 2):  # an odd and an even last bit, with exactly half an ulp more
        for m in range(8):
            ties += [(1 + m * 2.0**-man_bits + 2.0 ** -(man_bits + 1)) * 2.0**e for e in (-20, -9, -7, -3, 0, 5)]
    tiny = [2.0**e * f for e in range(-30, -5) for f in (1.0, 1.25, 1.5, 1.75)]
    edge = [0.0, -0.0, 448.0, 449.0, 464.0, 480.0, 1e4, 57344.0, 61440.0, 65504.0, 65520.0, 1e6, 3e38,
            float("inf"), float("-inf")]
    specials = torch.tensor(ties + tiny + edge, dtype=torch.float32)
    return torch.cat([spread, specials, -specials])


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
def test_write_kernel_stores_the_bits_of_to_cache_dtype(kv_dtype):
    dtype = KV_DTYPES[kv_dtype]
    values = special_values()
    num_tokens = -(-values.numel() // (3 * 64))
    values = torch.cat([values, torch.zeros(num_tokens * 3 * 64 - values.numel())])
    # k and v as the model hands them over: column slices of one fused qkv row.
    qkv = torch.zeros(num_tokens, (9 + 3 + 3) * 64)
    qkv[:, 9 * 64 : 12 * 64] = values.view(num_tokens, -1)
    qkv[:, 12 * 64 :] = -values.view(num_tokens, -1).flip(0)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(-1, 3, 64), qkv[:, 12 * 64 :].view(-1, 3, 64)
    slots = torch.randperm(num_tokens + 5, generator=torch.Generator().manual_seed(1))[:num_tokens]
    cache = torch.zeros(2, -(-(num_tokens + 5) // 16), 16, 3, 64, dtype=dtype)
    expected = cache.clone()
    write_kv(k, v, expected, slots)
    triton_kernels.write_kv(cache, k, v, slots)
    assert torch.equal(bits(cache), bits(expected))


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
def test_write_kernel_keeps_nan_and_skips_negative_slots(kv_dtype):
    dtype = KV_DTYPES[kv_dtype]
    k = torch.randn(3, 2, 64)
    k[1, 0, 5] = float("nan")
    v = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 1, 16, 2, 64, dtype=dtype)
    triton_kernels.write_kv(cache, k, v, torch.tensor([4, 7, -1]))
    stored = cache.float()
    assert stored[0, 0, 7, 0, 5].isnan() and stored.isnan().sum() == 1
    expected = torch.zeros_like(stored)
    expected[0, 0, [4, 7]] = to_cache_dtype(k[:2], dtype).float()
    expected[1, 0, [4, 7]] = to_cache_dtype(v[:2], dtype).float()
    torch.testing.assert_close(stored, expected, rtol=0, atol=0, equal_nan=True)  # slot -1: nothing


def test_bad_inputs_are_rejected_with_the_parameter_named():
    q, k, v, cache, meta = random_step([(1, 9)], 9, 3, 64, 8)
    with pytest.raises(ValueError, match="block_size"):
        TritonPagedAttention().forward(q, k, v, cache, meta, 0.1)
    q, k, v, cache, meta = random_step([(1, 9)], 9, 3, 64, 16)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        TritonPagedAttention().forward(q, k, v, cache.double(), meta, 0.1)
    with pytest.raises(ValueError, match="q must be contiguous"):
        TritonPagedAttention().forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cache, meta, 0.1)


def test_selector_and_the_reason_when_triton_is_missing(monkeypatch):
    assert isinstance(get_backend("triton"), TritonPagedAttention)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now fails
    assert "triton is not installed" in triton_unavailable_reason()
    with pytest.raises(ValueError, match="triton attention backend cannot run"):
        TritonPagedAttention()


def test_the_device_check_passes_on_the_cpu():
    # What benchmarks/gpu_check.sh runs on a GPU (attention.testing.device_check), here on
    # small steps so that the interpreter gets through it.
    steps = [("decode", [(1, 5), (1, 40)], 8, 2, 64, 16), ("mixed", [(1, 12), (9, 30)], 9, 3, 64, 16)]
    results = device_check(TritonPagedAttention(2), "cpu", steps, kv_dtypes=(torch.float32, torch.float8_e5m2))
    assert len(results) == 2 * 2 * 2
    assert all(r["within_tolerance"] and r["cache_bytes_equal"] for r in results), results


@pytest.mark.slow
@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_contexts_sweep(num_heads, num_kv_heads, head_dim, block_size):
    rnd = random.Random(num_heads * head_dim + block_size)
    kv_dtype = rnd.choice(["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"])  # the interpreter is slow: one per case
    seqs = [(rnd.choice([1, 1, 2, 4, 15]), rnd.randint(16, 1500)) for _ in range(6)] + [(1, 2048), (150, 900)]
    assert_backend_matches(seqs, num_heads, num_kv_heads, head_dim, block_size, KV_DTYPES[kv_dtype], seed=block_size)
    decodes = [(1, rnd.randint(1, 2048)) for _ in range(5)]
    assert_backend_matches(decodes, num_heads, num_kv_heads, head_dim, block_size, KV_DTYPES[kv_dtype],
                           decode_segments=16)


@pytest.fixture(scope="module")
def tiny_model(gguf_path, tmp_path_factory):
    """A two-layer random-weight Llama (4 query / 2 KV heads of 32): small enough for
    the interpreter to run every attention layer of a few engine steps."""
    import transformers

    from pagedserve.model.loader import load_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_model(gguf_path).tokenizer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save(folder)
    return load_model(folder)


def test_engine_greedy_output_equals_the_cpu_backend(tiny_model):
    from engine_utils import assert_all_blocks_free, make_llm
    from pagedserve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = list(range(100, 140))  # two prompts share two and a half blocks: a prefix-cache hit
    prompts = [shared + [7, 8, 9], list(range(300, 311)), shared + [5]]
    tokens = {}
    for backend in ("cpu", "triton"):
        # A 16-token budget: the long prompts are prefilled in chunks over their cached context.
        llm = make_llm(tiny_model, attention_backend=backend, max_num_batched_tokens=16, max_num_seqs=4)
        assert llm.engine.runner.backend.name == backend
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
        assert_all_blocks_free(llm)
    assert tokens["triton"] == tokens["cpu"]
