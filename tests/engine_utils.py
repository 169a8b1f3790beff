"""Helpers for tests that drive the engine on the real model."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams
from pagedserve.outputs import OutputAccumulator, RequestOutput

KV_BYTES_PER_BLOCK = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2-135M, fp32, block 16


def make_llm(loaded, **options) -> LLM:
    """An LLM over the already-loaded weights (loading is not what these tests test)."""
    from pagedserve.engine_config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    options.setdefault("kv_cache_memory", 256 * KV_BYTES_PER_BLOCK)
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig(**options), loaded=loaded)
    return llm


def greedy_tokens(loaded, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    """Each prompt's greedy tokens (ignoring EOS) through an engine over `loaded`."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in make_llm(loaded).generate(prompts, greedy, use_tqdm=False)]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    llm.engine.scheduler.check_invariants()


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=seed, max_tokens=24, ignore_eos=True)


def busy_batch(tokenizer) -> tuple[list, list[SamplingParams]]:
    """32 mixed requests: long and short prompts, greedy and seeded sampling, some
    sharing a prefix so the prefix cache gets hits."""
    shared = tokenizer.encode("You are a careful assistant. Answer briefly and precisely. " * 6)
    prompts, params = [], []
    for i in range(32):
        if i % 4 == 0:
            prompts.append(shared + tokenizer.encode(f" Question {i}: what is {i} + {i}?"))
        elif i % 4 == 1:
            prompts.append(tokenizer.encode(f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 9 + 1)))
        else:
            prompts.append(tokenizer.encode(f"List {i} facts about the number {i * 7}:"))
        params.append(GREEDY if i % 2 == 0 else seeded(1000 + i))
    return prompts, params


BUSY_PROBES = (0, 1, 5, 8, 13)  # greedy and seeded, short and long, shared-prefix and not


def check_busy_batch(llm: LLM, expect_preemption: bool = False) -> dict[int, list[int]]:
    """Each probe of busy_batch gives the same tokens alone, inside the batch and again
    with prefix-cache hits; nothing leaks. Returns the probes' tokens."""
    prompts, params = busy_batch(llm.tokenizer)
    alone = {i: llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids for i in BUSY_PROBES}
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in BUSY_PROBES:
        assert batch[i].outputs[0].token_ids == alone[i], f"request {i} differs inside the batch"
    again = llm.generate(prompts, params, use_tqdm=False)
    for i in BUSY_PROBES:
        assert again[i].outputs[0].token_ids == alone[i], f"request {i} differs with prefix-cache hits"
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    if expect_preemption:
        assert stats["num_preemptions"] > 0, "the small pool was meant to force preemption"
    assert_all_blocks_free(llm)
    return alone


def busy_batch_bits(llm: LLM, max_tokens: int = 8) -> list[list[int]]:
    """busy_batch_tokens for greedy requests, bit for bit: the first two requests' tokens
    and the logprobs of each (their logits' bits, as the sampler saw them) are the same
    alone and inside the batch. The native kernels promise this on every CPU; the torch
    path does not (its flash attention and MKL products block by the batch's shape)."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    prompts = busy_batch(llm.tokenizer)[0][:6]

    def bits(completion) -> list[tuple[int, float]]:
        return [(t, lp[t].logprob) for t, lp in zip(completion.token_ids, completion.logprobs)]

    alone = [bits(llm.generate([prompts[i]], greedy, use_tqdm=False)[0].outputs[0]) for i in (0, 1)]
    batch = llm.generate(prompts, greedy, use_tqdm=False)
    assert [bits(out.outputs[0]) for out in batch[:2]] == alone
    assert_all_blocks_free(llm)
    return [out.outputs[0].token_ids for out in batch]


def busy_batch_tokens(llm, params) -> list[list[int]]:
    """Six busy_batch prompts (long and short, two sharing a cached prefix) run together:
    the first two give the tokens they give alone, and every block comes back."""
    prompts = busy_batch(llm.tokenizer)[0][:6]
    alone = [llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0].token_ids for i in (0, 1)]
    batch = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert batch[:2] == alone
    assert_all_blocks_free(llm)
    return batch


def run_engine_to_completion(engine) -> dict[str, RequestOutput]:
    """Step `engine` until every request it holds has finished; each one's accumulated output."""
    done, outputs = {}, OutputAccumulator()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out = outputs.add(delta)
            if out.finished:
                done[out.request_id] = out
    return done
