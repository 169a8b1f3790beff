"""The engine end to end on the real model: greedy equals the reference; the same
request gives the same tokens alone and inside a busy batch, with small prefill
chunks, prefix-cache hits and forced preemption; n > 1 shares the prompt's blocks;
stop strings; nothing leaks."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import REFERENCE_NEW_TOKENS
from engine_utils import KV_BYTES_PER_BLOCK, assert_all_blocks_free, check_busy_batch, make_llm
from pagedserve import SamplingParams
from pagedserve.core.request import RequestStatus
from pagedserve.model.loader import load_model
from pagedserve.outputs import OutputAccumulator


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def test_greedy_matches_reference_in_one_batch(loaded, reference_prompts, reference_greedy, hf_tokenizer):
    llm = make_llm(loaded)
    params = SamplingParams(temperature=0, max_tokens=REFERENCE_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(reference_prompts, params, use_tqdm=False)
    for out, ref in zip(outs, reference_greedy):
        assert out.outputs[0].token_ids[: len(ref)] == ref
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # the default chunked scheduler, a roomy pool
        dict(max_num_batched_tokens=32, max_num_seqs=32),  # prefills cut into 32-token chunks
        # The other policies only choose which rows a step holds; the runner's rows are the same.
        pytest.param(dict(policy="continuous"), marks=pytest.mark.slow),
        pytest.param(dict(policy="static"), marks=pytest.mark.slow),  # finished rows keep computing padding tokens
        dict(kv_cache_memory=40 * KV_BYTES_PER_BLOCK, max_num_batched_tokens=64, max_num_seqs=32),  # preemption
    ],
    ids=["chunked", "small-chunks", "continuous", "static", "preemption"],
)
def test_same_tokens_alone_and_in_a_busy_batch(loaded, options):
    check_busy_batch(make_llm(loaded, **options), expect_preemption="kv_cache_memory" in options)


def test_parallel_sampling_shares_prompt_blocks(loaded):
    llm = make_llm(loaded)
    engine = llm.engine
    prompt = llm.tokenizer.encode("Write a haiku about the sea. " * 8)[:40]  # 2 full blocks + 8 tokens
    assert len(prompt) == 40
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    kv = engine.scheduler.kv_cache
    outputs = OutputAccumulator()
    deltas = engine.step()  # prefill + fork: 4 samples, the prompt's 3 blocks shared by all
    assert kv.num_blocks - kv.num_free_blocks == 3
    deltas += engine.step()  # each sample writes into the shared partial block: copy-on-write
    # 2 shared full blocks + 4 private copies of the partial block (12 without sharing).
    assert kv.num_blocks - kv.num_free_blocks == 2 + 4
    while engine.has_unfinished_requests():
        deltas += engine.step()
    # Each sample says it finished exactly once, on its last delta; the request's last delta says so too.
    ends = [(s.index, s.finish_reason) for d in deltas for s in d.samples if s.finish_reason is not None]
    assert sorted(ends) == [(i, "length") for i in range(4)]
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    outs = [o for o in map(outputs.add, deltas) if o.finished]
    (out,) = outs
    assert out.request_id == rid and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "4 samples at temperature 1 should differ"
    assert_all_blocks_free(llm)


def test_seeded_parallel_samples_are_reproducible(loaded):
    llm = make_llm(loaded)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate("Name a colour:", params, use_tqdm=False)[0]
    b = llm.generate(["Name a colour:", "Something else entirely", "Third"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_all_blocks_free(llm)


def test_stop_string_across_token_boundary(loaded):
    llm = make_llm(loaded)
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ids = full.outputs[0].token_ids
    tok = llm.tokenizer
    # A stop string made of the end of token 2 and the start of token 3.
    t2, t3 = tok.decode(ids[2:3]), tok.decode(ids[3:4])
    assert t2 and t3
    stop = t2[-1:] + t3[:1]
    expected = full.outputs[0].text[: full.outputs[0].text.index(stop)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_all_blocks_free(llm)


def test_streamed_deltas_add_up_to_the_text(loaded):
    llm = make_llm(loaded)
    engine = llm.engine
    prompt = "Tell me about Paris."
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    text = "".join(s.text for d in deltas for s in d.samples)
    ids = [t for d in deltas for s in d.samples for t in s.token_ids]
    # Frozen: a delta is never changed after the step that made it.
    with pytest.raises(dataclasses.FrozenInstanceError):
        deltas[0].samples[0].text = ""
    # The first delta alone carries the prompt; the last alone the metrics and the end.
    assert deltas[0].prompt == prompt and deltas[0].prompt_token_ids == tuple(llm.tokenizer.encode(prompt))
    assert all(d.prompt is None and d.prompt_token_ids is None for d in deltas[1:])
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(d.metrics is None for d in deltas[:-1])
    outputs = OutputAccumulator()
    final = [outputs.add(d) for d in deltas][-1]
    assert final.finished and text == final.outputs[0].text and ids == final.outputs[0].token_ids
    assert final.prompt == prompt and final.prompt_token_ids == list(deltas[0].prompt_token_ids)
    assert deltas[-1].finish_reason == final.outputs[0].finish_reason in ("stop", "length")
    m = final.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert_all_blocks_free(llm)


def test_bad_requests_raise_and_leave_the_engine_working(loaded):
    llm = make_llm(loaded, kv_cache_memory=20 * KV_BYTES_PER_BLOCK)
    engine = llm.engine
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("hi", SamplingParams(max_tokens=20 * 16))  # can never fit the pool
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 10**9], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("hi", SamplingParams(max_tokens=4, logit_bias={10**9: 1.0}))
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_abort_frees_blocks(loaded):
    llm = make_llm(loaded)
    engine = llm.engine
    rid = engine.add_request("Count to one hundred: 1, 2, 3,", SamplingParams(max_tokens=50, ignore_eos=True))
    other = engine.add_request("Another request", SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    first, second = engine.abort(rid), engine.abort(other)
    # The last delta of each: every unfinished sample ends with "abort", and no metrics.
    assert (first.finished, first.finish_reason, first.metrics) == (True, "abort", None)
    assert [(s.index, s.finish_reason) for s in first.samples] == [(0, "abort")]
    assert [(s.index, s.finish_reason) for s in second.samples] == [(0, "abort"), (1, "abort")]
    assert engine.abort(rid) is None  # already gone
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_attention_timer_times_real_steps_and_restores_the_backend(loaded):
    llm = make_llm(loaded)
    runner = llm.engine.runner
    plain = runner.backend
    with runner.attention_timer() as timed:
        llm.generate(["Count to five: 1,"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert timed.seconds > 0 and timed.inner is plain
    assert runner.backend is plain


def test_finished_status_names():
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


def test_logprobs_of_greedy_tokens(loaded):
    llm = make_llm(loaded)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)
    c = out[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        values = [lp.logprob for lp in entry.values()]
        assert max(values) == entry[tok].logprob <= 0.0
        assert sorted((lp.rank for lp in entry.values())) == [1, 2, 3]
    assert_all_blocks_free(llm)


def _steps_to_first_token(engine, request_id: str, outputs: OutputAccumulator) -> int:
    for steps in range(1, 50):
        for out in map(outputs.add, engine.step()):
            if out.request_id == request_id and out.outputs and out.outputs[0].token_ids:
                return steps
    raise AssertionError(f"{request_id} produced nothing in 50 steps")


def test_a_high_priority_request_under_a_full_batch_starts_as_on_an_idle_engine(loaded):
    """--scheduling-policy priority: with every seat taken by low-priority streams, a
    higher-priority request's first token comes within 2 steps of an idle engine's, and
    the stream that gave way still ends with its own greedy tokens."""
    prompt = loaded.tokenizer.encode("Name three colours.")
    urgent = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    idle = make_llm(loaded, scheduling_policy="priority", max_num_seqs=4).engine
    idle.add_request(prompt, urgent, request_id="urgent")
    idle_steps = _steps_to_first_token(idle, "urgent", OutputAccumulator())

    llm = make_llm(loaded, scheduling_policy="priority", max_num_seqs=4)
    engine = llm.engine
    stream = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    low_prompts = [loaded.tokenizer.encode(f"Story {i}: once upon a time") for i in range(4)]
    for i, p in enumerate(low_prompts):
        engine.add_request(p, stream, request_id=f"low{i}", priority=1)
    outputs = OutputAccumulator()
    for _ in range(3):
        for delta in engine.step():
            outputs.add(delta)
    assert engine.scheduler.stats().num_running == 4
    engine.add_request(prompt, urgent, request_id="urgent", priority=0)
    assert _steps_to_first_token(engine, "urgent", outputs) <= idle_steps + 2
    assert engine.scheduler.num_preemptions == 1
    finished = {}
    while engine.has_unfinished_requests():
        for out in map(outputs.add, engine.step()):
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    alone = make_llm(loaded).generate(low_prompts, stream, use_tqdm=False)
    assert [finished[f"low{i}"] for i in range(4)] == [o.outputs[0].token_ids for o in alone]
    assert_all_blocks_free(llm)
