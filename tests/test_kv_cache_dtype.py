"""KV caches of fp16 and fp8 (`--kv-cache-dtype`): the native ops and the torch path
store the same bits and attend over the same rounded values as the reference; the
engine sizes the pool by the narrower width and keeps its block accounting."""
from __future__ import annotations

import pytest
import torch

from pagedserve.attention.backend import ReferenceBackend, to_cache_dtype, write_kv
from pagedserve.attention.cpu_backend import PREFILL_MIN_QUERY_LEN, CpuPagedAttention
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.attention.testing import random_step
from pagedserve.engine_config import EngineConfig
from pagedserve.kernels import native_unavailable_reason
from pagedserve.worker.kv_tensors import kv_cache_torch_dtype

NARROW = {"fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DTYPES = pytest.mark.parametrize("dtype", list(NARROW.values()), ids=list(NARROW))


@pytest.fixture(scope="module", autouse=True)
def native_library():
    assert native_unavailable_reason() is None


def narrow_step(seqs, dtype, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=0):
    q, k, v, cache, meta = random_step(seqs, num_heads, num_kv_heads, head_dim, block_size, seed)
    return q, k, v, to_cache_dtype(cache, dtype), meta


def native_op(q, cache, meta, scale):
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2])
    torch.ops.pagedserve.paged_attention_(out, q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                          torch.arange(meta.num_seqs), scale)
    return out


@DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_op_reads_narrow_blocks_as_the_reference_does(dtype, num_heads, num_kv_heads, head_dim, block_size):
    # Decodes on and off block boundaries and short causal queries; the reference reads
    # the same rounded values, so only fp32 summation order differs.
    seqs = [(1, n) for n in (1, 15, 16, 17, 33, 513)] + [(3, 3), (5, 40), (PREFILL_MIN_QUERY_LEN - 1, 48)]
    q, k, v, cache, meta = narrow_step(seqs, dtype, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, scale)
    torch.ops.pagedserve.write_kv_(cache, k, v, meta.slot_mapping)
    torch.testing.assert_close(native_op(q, cache, meta, scale), expected, rtol=1e-5, atol=2e-6)


@DTYPES
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_one_long_sequence_split_across_threads(dtype, threads):
    q, k, v, cache, meta = narrow_step([(1, 3000), (4, 700)], dtype)
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, 0.125)
    torch.ops.pagedserve.write_kv_(cache, k, v, meta.slot_mapping)
    torch.testing.assert_close(native_op(q, cache, meta, 0.125), expected, rtol=1e-5, atol=2e-6)


@DTYPES
def test_native_and_torch_writes_store_the_same_bits(dtype):
    _, _, _, cache, meta = narrow_step([(1, 7), (20, 26), (3, 12)], dtype)
    qkv = torch.randn(meta.num_tokens, 15 * 64) * 3
    # Past fp8's range, both saturate at the largest finite value instead of NaN or inf.
    qkv[0, 9 * 64 : 9 * 64 + 4] = torch.tensor([1e3, -1e3, 1e6, -1e6])
    k, v = qkv[:, 9 * 64 : 12 * 64].view(-1, 3, 64), qkv[:, 12 * 64 :].view(-1, 3, 64)
    expected = cache.clone()
    write_kv(k, v, expected, meta.slot_mapping)
    torch.ops.pagedserve.write_kv_(cache, k, v, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()


@DTYPES
@pytest.mark.parametrize("backend", [NativePagedAttention, CpuPagedAttention], ids=["native", "cpu"])
def test_backends_on_a_mixed_step(dtype, backend):
    # Long prefill chunks attend their own fp32 K/V and read earlier context from the cache.
    long = PREFILL_MIN_QUERY_LEN + 5
    seqs = [(1, 12), (long, long + 9), (4, 57), (300, 700), (1, 1500)]
    q, k, v, cache, meta = narrow_step(seqs, dtype)
    expected_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, expected_cache, meta, 0.125)
    got = backend().forward(q, k, v, cache, meta, 0.125)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    # Every row attends the rounded K/V the reference reads, prefill chunks' own keys
    # included (so a token's output is the same whichever chunk held its keys): only fp32
    # summation order differs.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_names_map_to_torch_dtypes_and_bad_ones_are_rejected():
    assert kv_cache_torch_dtype("auto") == torch.float32
    assert kv_cache_torch_dtype("fp8_e4m3") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.fixture(scope="module")
def loaded():
    from pagedserve.model.loader import load_model

    return load_model()


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "fp8_e5m2"])
def test_engine_pool_is_sized_by_the_width_and_keeps_its_accounting(loaded, name):
    from engine_utils import KV_BYTES_PER_BLOCK, assert_all_blocks_free, busy_batch, busy_batch_bits, make_llm

    from pagedserve import SamplingParams

    for kernels in ("native", "torch"):
        # Small chunks: prompts are cut differently alone and beside the others.
        llm = make_llm(loaded, kernels=kernels, kv_cache_dtype=name, max_num_batched_tokens=24, max_num_seqs=8,
                       kv_cache_memory=64 * KV_BYTES_PER_BLOCK)
        assert llm.engine.runner.kv_caches[0].dtype == kv_cache_torch_dtype(name)
        assert llm.stats()["kv_total_blocks"] == 64 * 4 // kv_cache_torch_dtype(name).itemsize
        if kernels == "native":
            # Bit for bit: a narrow cache rounds K/V, so any difference in how a prompt was
            # attended (its chunking, the batch around a row) can become another token.
            busy_batch_bits(llm)
        else:
            # The torch path's rows depend on the batch's shape in the last bits (flash
            # attention, MKL), which a narrow cache's rounding may carry into the tokens:
            # only its accounting is promised.
            llm.generate(busy_batch(llm.tokenizer)[0][:6], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)
            assert_all_blocks_free(llm)
