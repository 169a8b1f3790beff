"""The contiguous KV layout (--kv-layout contiguous) on the real model and a real mapping:
the same tokens as the paged layout (greedy and seeded, alone and in a busy batch, with
preemption, with speculative decoding); the OS's committed pages follow the written
tokens exactly and return to zero after requests end or are aborted; admission never
takes the cache past --kv-cache-memory; the attention backends match the reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_utils import KV_BYTES_PER_BLOCK, assert_all_blocks_free, busy_batch, make_llm
from pagedserve import SamplingParams
from pagedserve.attention.backend import ReferenceBackend, to_cache_dtype
from pagedserve.attention.contiguous_backend import ContiguousAttention, NativeContiguousAttention
from pagedserve.attention.testing import contiguous_step
from pagedserve.engine_config import EngineConfig
from pagedserve.engine.dashboard_feed import DashboardFeed
from pagedserve.model.loader import load_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROBES = (0, 1)  # a greedy shared-prefix prompt and a seeded story


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def workload(tokenizer) -> tuple[list, list[SamplingParams]]:
    """Six of the busy batch's requests (long and short prompts, greedy and seeded), 8 tokens each."""
    prompts, params = busy_batch(tokenizer)
    pick = (0, 1, 2, 3, 5, 9)
    return [prompts[i] for i in pick], [dataclasses.replace(params[i], max_tokens=8) for i in pick]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_nothing_committed(llm) -> None:
    store = llm.engine.kv_store
    assert store.resident_bytes() == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=32, max_num_seqs=8),  # prefills in 32-token chunks
        dict(kv_cache_memory=8 * KV_BYTES_PER_BLOCK, max_num_batched_tokens=64, max_num_seqs=8),  # preemption
        dict(speculative_config=NGRAM),
    ],
    ids=["chunked", "preemption", "ngram"],
)
def test_same_tokens_as_the_paged_layout(loaded, options):
    paged = make_llm(loaded, enable_prefix_caching=False, **options)
    prompts, params = workload(paged.tokenizer)
    expected = token_ids(paged.generate(prompts, params, use_tqdm=False))
    llm = make_llm(loaded, kv_layout="contiguous", **options)
    alone = {i: token_ids(llm.generate([prompts[i]], params[i], use_tqdm=False))[0] for i in PROBES}
    got = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert got == expected
    assert all(got[i] == alone[i] for i in PROBES)
    stats = llm.stats()
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0, "the small budget was meant to force preemption"
    if "speculative_config" in options:
        assert stats["spec_num_accepted_tokens"] > 0
    assert_nothing_committed(llm)


def test_committed_pages_follow_the_tokens_and_aborts_give_them_back(loaded):
    llm = make_llm(loaded, kv_layout="contiguous", max_model_len=1024)
    engine, kv = llm.engine, llm.engine.scheduler.kv_cache
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, n in enumerate((7, 40, 90)):
        engine.add_request([100 + i + t for t in range(n)], params, request_id=str(i))
    feed = DashboardFeed()
    feed.watch(True)
    for _ in range(3):
        engine.step()
        kv.check_invariants()  # the OS holds exactly the pages of the written tokens
    frame = feed.build_frame(engine)  # the live page lists regions (no block map to draw)
    assert sorted(s["id"] for s in frame["seqs"]) == ["0", "1", "2"] and frame["blocks"]["owner"] == []
    # 7 + 2 written tokens: ceil(9 x 768 / 4096) = 2 pages in each of the 60 streams.
    assert engine.kv_store.committed_pages([(kv._rows["0"].index, 0, 4)]) == [120]  # pages 2, 3 empty
    assert kv.committed_bytes == engine.kv_store.resident_bytes() > 0
    engine.abort("1")
    kv.check_invariants()
    for rid in ("0", "2"):
        engine.abort(rid)
    assert not engine.has_unfinished_requests()
    assert_nothing_committed(llm)
    # The regions are reused: the next request gets region 0 again.
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert kv.peak_committed_pages > 0 and kv.num_os_readings > 0
    assert_nothing_committed(llm)


def test_admission_never_exceeds_the_configured_memory(loaded):
    # Each request: 40 + 6 tokens = ceil(46 x 768 / 4096) = 9 pages per stream, 540 in all;
    # the budget holds two of them.
    memory = 2 * 540 * 4096 + 4096
    llm = make_llm(loaded, kv_layout="contiguous", kv_cache_memory=memory, max_model_len=256)
    engine, kv = llm.engine, llm.engine.scheduler.kv_cache
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request([200 + 3 * i + t for t in range(40)], params)
    peak_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak_running = max(peak_running, len(engine.scheduler.running))
        assert engine.kv_store.resident_bytes() <= memory
    assert peak_running == 2
    assert kv.peak_committed_pages * 4096 <= memory
    with pytest.raises(ValueError, match="kv_cache_memory"):
        engine.add_request(list(range(150)), SamplingParams(max_tokens=100))  # 47 pages per stream
    with pytest.raises(ValueError, match="n > 1 needs kv_layout='paged'"):
        engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=2))
    assert_nothing_committed(llm)


def test_options_that_need_shared_pages_are_refused():
    with pytest.raises(ValueError, match="enable_prefix_caching needs kv_layout='paged'"):
        EngineConfig(kv_layout="contiguous", enable_prefix_caching=True).resolve("cpu")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(kv_layout="contiguous", speculative_config={"method": "draft_model", "model": "self:8"}).resolve("cpu")
    with pytest.raises(ValueError, match="needs kv_layout='contiguous'"):
        EngineConfig(attention_backend="contiguous").resolve("cpu")
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(kv_layout="virtual")
    assert EngineConfig(kv_layout="contiguous").resolve("cpu").kv.enable_prefix_caching is False
    assert EngineConfig().resolve("cpu").kv.enable_prefix_caching is True


@pytest.mark.parametrize("backend", [ContiguousAttention, NativeContiguousAttention], ids=["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_backends_match_the_reference(backend, dtype):
    seqs = [(1, 1), (1, 40), (5, 57), (300, 700), (1, 1500), (20, 29), (15, 15)]
    q, k, v, cache, meta = contiguous_step(seqs, 9, 3, 64, 16, region_tokens=2048)
    cache = to_cache_dtype(cache, dtype)
    expected_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, expected_cache, meta, 0.125)
    got = backend().forward(q, k, v, cache, meta, 0.125)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
