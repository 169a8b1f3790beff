"""Embeddings on the engine: pooled final hidden states against transformers'
`output_hidden_states` on a tiny random checkpoint transformers wrote, the same bits
alone and inside a busy generate batch, chunked prefill, prefix-cache hits, and no
leaked blocks."""
from __future__ import annotations

import math

import pytest
import torch

from engine_utils import assert_all_blocks_free, make_llm, run_engine_to_completion
from pagedserve import SamplingParams
from pagedserve.model.loader import load_model
from pagedserve.pooling_params import PoolingParams
from pooling_reference import reference_embedding as reference
from pooling_reference import save_tiny_llama

# fp32 engine vs fp32 transformers on the same weights: the products' summation orders differ.
ATOL = 2e-5


@pytest.fixture(scope="module")
def tiny(gguf_path, tmp_path_factory):
    """(transformers' model, our loaded model) of one random Llama checkpoint."""
    path = tmp_path_factory.mktemp("tiny-embed")
    ref = save_tiny_llama(path, load_model(gguf_path).tokenizer)
    return ref, load_model(path)


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in (
        "The quick brown fox jumps over the lazy dog.",
        "Embeddings map text to vectors; " * 12,
        "Paris is the capital of France.",
    )]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_hidden_states_match_transformers(tiny, pooling):
    ref, loaded = tiny
    # A small token budget splits the long prompt into chunks: pooling carries across them.
    llm = make_llm(loaded, kernels="torch", max_num_batched_tokens=32, max_num_seqs=8, pooling_type=pooling)
    ids = prompts(llm.tokenizer)
    assert len(ids[1]) > 64
    outs = llm.embed(ids, use_tqdm=False)
    for prompt, out in zip(ids, outs):
        assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        torch.testing.assert_close(torch.tensor(out.embedding), reference(ref, prompt, pooling), rtol=0, atol=ATOL)
    assert_all_blocks_free(llm)


def test_dimensions_truncate_then_normalise_and_raw_vectors(tiny):
    ref, loaded = tiny
    llm = make_llm(loaded, kernels="torch")
    ids = prompts(llm.tokenizer)[0]
    raw = llm.embed(ids, PoolingParams(normalize=False), use_tqdm=False)[0].embedding
    torch.testing.assert_close(torch.tensor(raw), reference(ref, ids, normalize=False), rtol=0, atol=ATOL)
    short = llm.embed(ids, PoolingParams(dimensions=16), use_tqdm=False)[0].embedding
    assert len(short) == 16
    torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(torch.tensor(raw[:16]), dim=0))
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(ids, PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_same_bits_alone_and_inside_a_busy_generate_batch(tiny, pooling):
    """The native kernels give a row the same bits whatever shares its step (docs/architecture.md);
    pooling keeps them: an embedding alone equals the same prompt's among generating requests,
    chunked differently, and again with prefix-cache hits (last pooling takes them)."""
    _, loaded = tiny
    llm = make_llm(loaded, max_num_batched_tokens=48, max_num_seqs=8, pooling_type=pooling)
    ids = prompts(llm.tokenizer)
    alone = [llm.embed(p, use_tqdm=False)[0].embedding for p in ids]
    engine = llm.engine
    gen = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in ids * 2]
    pooled = [engine.add_pooling_request(p) for p in ids]
    done = run_engine_to_completion(engine)
    assert all(len(done[g].outputs[0].token_ids) == 12 for g in gen)
    assert [done[r].embedding for r in pooled] == alone
    hits_before = llm.stats()["prefix_cache_hits"]
    assert [o.embedding for o in llm.embed(ids, use_tqdm=False)] == alone
    assert (llm.stats()["prefix_cache_hits"] > hits_before) == (pooling == "last")
    assert_all_blocks_free(llm)


def test_score_is_the_cosine_of_embeddings_and_tasks_refuse(tiny):
    _, loaded = tiny
    llm = make_llm(loaded, kernels="torch")
    texts = ["a cat sat", "a dog ran", "stock prices fell"]
    vectors = [o.embedding for o in llm.embed(texts, use_tqdm=False)]
    scores = llm.score(texts[0], texts[1:], use_tqdm=False)
    assert scores == pytest.approx([sum(x * y for x, y in zip(vectors[0], v)) for v in vectors[1:]], abs=1e-6)
    assert llm.score(texts[:2], texts[1:], use_tqdm=False) == pytest.approx(
        [sum(x * y for x, y in zip(vectors[0], vectors[1])), sum(x * y for x, y in zip(vectors[1], vectors[2]))],
        abs=1e-6)
    assert math.isclose(llm.score("same", "same", use_tqdm=False)[0], 1.0, abs_tol=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 items"):
        llm.score(texts[:2], texts, use_tqdm=False)
    assert_all_blocks_free(llm)
    embed_only = make_llm(loaded, kernels="torch", task="embed")
    with pytest.raises(ValueError, match="task 'embed'"):
        embed_only.generate("hi", use_tqdm=False)
    generate_only = make_llm(loaded, kernels="torch", task="generate")
    with pytest.raises(ValueError, match="task 'generate'"):
        generate_only.embed("hi", use_tqdm=False)


def test_a_preempted_pooling_request_recomputes_to_the_same_bits(tiny):
    """A pool too small for the batch preempts requests mid-prefill; a mean-pooled prompt
    then restarts from its first token and its partial sum is dropped, not added twice."""
    _, loaded = tiny
    kv_block = 2 * 2 * 2 * 16 * 4 * 16  # layers x (K, V) x kv heads x head_dim x fp32 x block of 16
    llm = make_llm(loaded, kv_cache_memory=12 * kv_block, max_num_batched_tokens=32, max_num_seqs=8,
                   pooling_type="mean")
    ids = prompts(llm.tokenizer)
    alone = [o.embedding for o in llm.embed(ids, use_tqdm=False)]
    engine = llm.engine
    for p in ids[1:]:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    pooled = [engine.add_pooling_request(p) for p in ids * 2]
    done = run_engine_to_completion(engine)
    assert any(done[r].metrics.num_preemptions for r in pooled), "a pooling request was meant to be preempted"
    assert [done[r].embedding for r in pooled] == alone * 2
    assert not engine.runner.pooling._partial
    assert_all_blocks_free(llm)
