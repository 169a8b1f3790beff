"""Structured output end to end on the real model: JSON schemas validate, regexes
full-match, choices and a Lark grammar hold, greedy output is the same alone and in a
busy mixed batch, n > 1 and preemption keep each sample's grammar state, bad specs
fail alone, and nothing leaks."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputs
from pagedserve.model.loader import load_model
from structured_schemas import SCHEMAS


KV_BYTES_PER_BLOCK = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2-135M, fp32, block 16
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def make_llm(loaded, **options) -> LLM:
    """An LLM over the already-loaded weights (loading is not what these tests test)."""
    from pagedserve.engine_config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    options.setdefault("kv_cache_memory", 512 * KV_BYTES_PER_BLOCK)
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig(**options), loaded=loaded)
    return llm


@pytest.fixture(scope="module")
def llm(loaded):
    # A small token budget: longer prompts are prefilled in chunks that sample nothing.
    return make_llm(loaded, max_num_batched_tokens=128, max_num_seqs=48)


def chat(llm: LLM, question: str) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    llm.engine.scheduler.check_invariants()


def json_params(schema: dict, **options) -> SamplingParams:
    options = {"temperature": 0, "max_tokens": MAX_TOKENS, **options}
    return SamplingParams(structured_outputs=StructuredOutputs(json=schema), **options)


def test_json_schemas_greedy_and_sampled_validate(llm):
    prompts = [chat(llm, f"{question} Answer in JSON.") for question, _ in SCHEMAS]
    params = [json_params(schema) for _, schema in SCHEMAS]
    params += [json_params(schema, temperature=0.9, top_p=0.95, seed=i) for i, (_, schema) in enumerate(SCHEMAS)]
    outs = llm.generate(prompts + prompts, params, use_tqdm=False)
    for out, (question, schema) in zip(outs, SCHEMAS + SCHEMAS):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (question, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    assert_all_blocks_free(llm)


def test_regex_choice_and_lark_grammar(llm):
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/'
    cases = [
        ("What is the phone number?", StructuredOutputs(regex=r"\d{3}-\d{4}"), re.compile(r"[0-9]{3}-[0-9]{4}")),
        ("Name an email address.", StructuredOutputs(regex=r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
         re.compile(r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)")),
        ("Is the sky blue?", StructuredOutputs(choice=["yes", "no", "maybe"]), re.compile("yes|no|maybe")),
        ("Write a sum.", StructuredOutputs(grammar=grammar), re.compile(r"[0-9()+*]+")),
    ]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec) for _, spec, _ in cases]
    # ignore_eos must not keep a complete grammar running: it ends with "stop" all the same.
    params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 structured_outputs=StructuredOutputs(choice=["left", "right"])))
    outs = llm.generate([chat(llm, q) for q, _, _ in cases] + [chat(llm, "Left or right?")], params, use_tqdm=False)
    for out, (question, _, pattern) in zip(outs, cases):
        text = out.outputs[0].text
        assert pattern.fullmatch(text), (question, text)
        assert out.outputs[0].finish_reason == "stop"
    sum_text = outs[3].outputs[0].text
    assert sum_text.count("(") == sum_text.count(")")
    assert outs[4].outputs[0].text in ("left", "right")
    assert outs[4].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)


def mixed_batch(llm: LLM) -> tuple[list[str], list[SamplingParams]]:
    """31 other requests: free and constrained, greedy and seeded, short and long prompts."""
    prompts, params = [], []
    for i in range(31):
        question, schema = SCHEMAS[(1, 2, 11, 17)[i % 4]]  # short answers
        long_tail = " Please think about it carefully." * (i % 5) * 3  # up to ~110 tokens: chunked
        prompts.append(chat(llm, f"{question}{long_tail}"))
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=12))
        else:
            params.append(json_params(schema, temperature=0.7, seed=i))
    return prompts, params


def test_same_greedy_output_alone_and_in_a_mixed_batch_of_32(llm):
    question, schema = SCHEMAS[0]
    target = chat(llm, f"{question} Answer in JSON.")
    alone = llm.generate([target], json_params(schema), use_tqdm=False)[0].outputs[0]
    prompts, params = mixed_batch(llm)
    outs = llm.generate(prompts[:16] + [target] + prompts[16:], params[:16] + [json_params(schema)] + params[16:],
                        use_tqdm=False)
    batched = outs[16].outputs[0]
    assert batched.token_ids == alone.token_ids
    jsonschema.validate(json.loads(batched.text), schema)
    for out, p in zip(outs[:16] + outs[17:], params):
        if p.structured_outputs is not None:
            jsonschema.validate(json.loads(out.outputs[0].text), json.loads(p.structured_outputs.json))
    assert_all_blocks_free(llm)


def test_parallel_samples_each_follow_the_grammar(llm):
    question, schema = SCHEMAS[4]
    out = llm.generate([chat(llm, f"{question} Answer in JSON.")],
                       json_params(schema, n=4, temperature=1.0, seed=7), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for sample in out.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)
    assert len({s.text for s in out.outputs}) > 1  # independent draws, not one copied matcher
    assert_all_blocks_free(llm)


def test_preempted_requests_keep_their_grammar_state(loaded, llm):
    chosen = [SCHEMAS[i] for i in (0, 5, 6, 12)]
    prompts = [chat(llm, f"{q} Answer in JSON. Be thorough and precise.") for q, _ in chosen]
    params = [json_params(schema) for _, schema in chosen]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # Ten blocks: three prompts fit, and their growing outputs then evict one another.
    small = make_llm(loaded, kv_cache_memory=10 * KV_BYTES_PER_BLOCK, max_num_batched_tokens=64, max_num_seqs=4)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out, (_, schema) in zip(outs, chosen):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert_all_blocks_free(small)


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "objekt"}), "invalid json"),
    (StructuredOutputs(json={"type": "string", "pattern": "([a-z]"}), "invalid json"),
    (StructuredOutputs(regex="(ab"), "unclosed group"),
    (StructuredOutputs(grammar="start: missing_rule"), "missing_rule"),
])
def test_invalid_spec_is_a_value_error_and_the_engine_keeps_serving(llm, spec, message):
    with pytest.raises(ValueError, match="structured_outputs") as error:
        llm.generate(["Hello"], SamplingParams(max_tokens=2, structured_outputs=spec), use_tqdm=False)
    assert message in str(error.value)
    assert_all_blocks_free(llm)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a|aa)+b?", r"^(\w+\s?)*$"])
def test_redos_patterns_compile_fast_and_generate(llm, pattern):
    start = time.monotonic()
    out = llm.generate([chat(llm, "Say aaa.")], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(regex=pattern)), use_tqdm=False)
    # Eight small steps; a backtracking matcher would hang on these patterns instead.
    assert time.monotonic() - start < 60
    # Every prefix of a match is a match here, so even a length-cut output must match.
    assert re.fullmatch(pattern, out[0].outputs[0].text), out[0].outputs[0].text
    assert_all_blocks_free(llm)


def test_a_grammar_the_vocabulary_cannot_finish_ends_with_error_and_a_valid_prefix(llm):
    # The choice's 4-byte character starts with byte f1, which no SmolLM2 token spells.
    choice = "\u008e\u00c3\u009a\U0007ff69"
    spec = StructuredOutputs(choice=[choice, "ok"])
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=32, structured_outputs=spec) for seed in range(6)]
    params.append(SamplingParams(temperature=0, max_tokens=32, n=2, structured_outputs=StructuredOutputs(choice=[choice])))
    outs = llm.generate(["Hey"] * len(params), params, use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            # Either the choice the vocabulary can spell, or a prefix of the other and "error".
            assert (c.text, c.finish_reason) == ("ok", "stop") or (
                c.finish_reason == "error" and choice.startswith(c.text) and len(c.text) <= 3), (c.text, c.finish_reason)
    assert any(c.finish_reason == "error" for out in outs for c in out.outputs)
    assert_all_blocks_free(llm)
