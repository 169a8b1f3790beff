"""Reasoning in every API, read by the official openai and anthropic clients: a tiny
Qwen3-shaped model (tests/reasoning_model.py) whose reply is known, served with a
Qwen3-style and an R1-style chat template; the parser is detected from each template."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from reasoning_model import ANSWER, QWEN3_TEMPLATE, R1_TEMPLATE, REASONING, write_reasoning_model
from pagedserve.model.tokenizer import load_tokenizer

from .server_process import ServerProcess, start_server

TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "deepseek_r1": R1_TEMPLATE}
HELLO = [{"role": "user", "content": "Hi there"}]
# The R1 prompt opened <think>, so its reply starts inside the section.
SECTIONS = {"qwen3": f"<think>{REASONING}</think>", "deepseek_r1": f"{REASONING}</think>"}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def reasoning_server(request, tmp_path_factory, server_logs) -> Iterator[tuple[str, ServerProcess, int]]:
    """(parser name, server, the reply's reasoning tokens) for each template."""
    folder = write_reasoning_model(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])
    proc = start_server(server_logs, "--model", str(folder), "--max-model-len", "4096", "--served-model-name", "m")
    num_reasoning = len(load_tokenizer(folder).encode(SECTIONS[request.param], add_special_tokens=False))
    yield request.param, proc, num_reasoning
    proc.stop()


@pytest.fixture(scope="module")
def oai(reasoning_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=reasoning_server[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(reasoning_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=reasoning_server[1].url, api_key="unused", max_retries=0, timeout=60)


def test_chat_splits_reasoning_from_the_answer(oai):
    r = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=40, n=2)
    for choice in r.choices:  # each choice parsed on its own
        assert choice.message.reasoning_content == REASONING and choice.message.content == ANSWER
        assert choice.finish_reason == "stop"


def test_chat_usage_counts_the_reasoning_tokens(oai, reasoning_server):
    r = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=40, n=2)
    assert r.usage.completion_tokens_details.reasoning_tokens == 2 * reasoning_server[2]  # both choices
    chunks = list(oai.chat.completions.create(model="m", messages=HELLO, max_tokens=40, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_server[2]


def test_chat_stream_carries_reasoning_deltas(oai):
    reasoning, content, kinds = "", "", []
    for chunk in oai.chat.completions.create(model="m", messages=HELLO, max_tokens=40, stream=True):
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        reasoning += piece or ""
        content += delta.content or ""
        kinds += ["reasoning"] * bool(piece) + ["content"] * bool(delta.content)
    assert reasoning == REASONING and content == ANSWER
    assert kinds.index("content") > kinds.index("reasoning") and kinds.count("reasoning") > 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reasoning_cut_off_by_max_tokens_is_all_reasoning(oai, stream):
    fields = dict(model="m", messages=HELLO, max_tokens=4)
    if stream:
        chunks = list(oai.chat.completions.create(**fields, stream=True))
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = oai.chat.completions.create(**fields).choices[0]
        reasoning, content, finish = choice.message.reasoning_content, choice.message.content or "", \
            choice.finish_reason
    assert finish == "length" and content == "" and REASONING.startswith(reasoning) and reasoning


def test_enable_thinking_false(oai, reasoning_server):
    r = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=40,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = r.choices[0].message
    if reasoning_server[0] == "qwen3":  # the template closes an empty section: nothing to parse
        assert message.content == ANSWER and message.reasoning_content is None
    else:  # R1's template does not read it (as in vLLM): the reply is unchanged
        assert message.content == ANSWER and message.reasoning_content == REASONING


def test_budget_fields_are_accepted(oai):
    fields = dict(model="m", messages=HELLO, max_tokens=40)
    for extra in ({"thinking_token_budget": 0}, {"thinking_token_budget": 64}, {"reasoning_effort": "high"}):
        assert oai.chat.completions.create(**fields, extra_body=extra).choices[0].message.content
    text = oai.completions.create(model="m", prompt="<|im_start|>assistant\n", max_tokens=40,
                                  extra_body={"thinking_token_budget": 64}).choices[0].text
    assert ANSWER in text  # completions return the text whole


@pytest.mark.parametrize("extra, param", [
    ({"thinking_token_budget": 10**12}, "thinking_token_budget"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": "low", "thinking_token_budget": 5}, "thinking_token_budget"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_bad_budget_fields_are_400(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=HELLO, max_tokens=8, extra_body=extra)
    assert e.value.body["param"] == param


def test_budget_with_beam_search_is_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="Hi", max_tokens=4, n=2,
                               extra_body={"use_beam_search": True, "thinking_token_budget": 8})
    assert e.value.body["param"] == "thinking_token_budget"


def test_responses_reasoning_item_and_tokens(oai, reasoning_server):
    r = oai.responses.create(model="m", input="Hi there", max_output_tokens=40, reasoning={"effort": "low"})
    item, message = r.output
    assert item.type == "reasoning" and item.summary == [] and item.id.startswith("rs_")
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", REASONING)]
    assert message.type == "message" and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == reasoning_server[2]


def test_responses_stream(oai, reasoning_server):
    events = list(oai.responses.create(model="m", input="Hi there", max_output_tokens=40, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == REASONING and text == ANSWER
    kinds = [e.type for e in events]
    # The reasoning item closes before the message opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == reasoning_server[2]


def test_responses_bad_effort_names_reasoning(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input="Hi", max_output_tokens=8, reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning"


THINKING = {"type": "enabled", "budget_tokens": 1024}


def test_messages_thinking_block(claude):
    m = claude.messages.create(model="m", max_tokens=2000, messages=HELLO, thinking=THINKING)
    thinking, text = m.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING
    assert thinking.signature == hashlib.sha256(REASONING.encode()).hexdigest()
    assert text.type == "text" and text.text == ANSWER and m.stop_reason == "end_turn"


def test_messages_without_thinking_drop_the_reasoning(claude):
    [text] = claude.messages.create(model="m", max_tokens=40, messages=HELLO).content
    assert text.text == ANSWER


def test_messages_stream_thinking(claude):
    events = list(claude.messages.create(model="m", max_tokens=2000, messages=HELLO, thinking=THINKING,
                                         stream=True))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert starts == ["thinking", "text"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert [d.signature for d in deltas if d.type == "signature_delta"] == \
        [hashlib.sha256(REASONING.encode()).hexdigest()]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER


def test_messages_thinking_round_trip(claude):
    """An earlier reply's thinking block sent back is accepted (and left out of the prompt)."""
    first = claude.messages.create(model="m", max_tokens=2000, messages=HELLO, thinking=THINKING)
    turns = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": "And again?"}]
    assert claude.messages.create(model="m", max_tokens=40, messages=turns).content[0].text == ANSWER


def test_count_tokens_is_the_prompt_messages_renders(claude, reasoning_server):
    """Earlier thinking blocks are left out of the prompt, and `thinking: disabled` is the
    template switch it is in /v1/messages: count_tokens counts what that request renders."""
    first = claude.messages.create(model="m", max_tokens=2000, messages=HELLO, thinking=THINKING)
    blocks = [b.model_dump() for b in first.content]
    turns = [*HELLO, {"role": "assistant", "content": blocks}, {"role": "user", "content": "And again?"}]
    without = [*HELLO, {"role": "assistant", "content": blocks[1:]}, {"role": "user", "content": "And again?"}]
    counts = {}
    for name, extra in (("default", {}), ("disabled", {"thinking": {"type": "disabled"}})):
        counted = claude.messages.count_tokens(model="m", messages=turns, **extra).input_tokens
        used = claude.messages.create(model="m", max_tokens=40, messages=turns, **extra).usage.input_tokens
        assert counted == used == claude.messages.count_tokens(model="m", messages=without, **extra).input_tokens
        counts[name] = counted
    # Qwen3's template writes an empty thinking section when told not to think; R1's ignores the switch.
    assert (counts["disabled"] > counts["default"]) == (reasoning_server[0] == "qwen3")


def test_messages_thinking_disabled(claude, reasoning_server):
    m = claude.messages.create(model="m", max_tokens=40, messages=HELLO, thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ANSWER


@pytest.mark.parametrize("thinking, max_tokens", [({"type": "enabled", "budget_tokens": 512}, 2000),
                                                  ({"type": "enabled", "budget_tokens": 1024}, 1024)])
def test_messages_bad_budget_is_400_in_anthropics_shape(claude, thinking, max_tokens):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=max_tokens, messages=HELLO, thinking=thinking)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "budget_tokens" in e.value.body["error"]["message"]


def test_without_a_reasoning_parser_budgets_are_400(tmp_path, server_logs):
    folder = write_reasoning_model(tmp_path / "model", QWEN3_TEMPLATE)
    proc = start_server(server_logs, "--model", str(folder), "--reasoning-parser", "none")
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            chat = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 40})
            message = chat.json()["choices"][0]["message"]
            assert "reasoning_content" not in message and message["content"].endswith(ANSWER)
            r = http.post("/v1/chat/completions", json={"messages": HELLO, "thinking_token_budget": 8})
            assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
            assert "--reasoning-parser" in r.json()["error"]["message"]
            r = http.post("/v1/messages", json={"messages": HELLO, "max_tokens": 2000, "thinking": THINKING})
            assert r.status_code == 400 and r.json()["type"] == "error"
            assert "thinking.budget_tokens" in r.json()["error"]["message"]
    finally:
        proc.stop()


def _tokens(server: ServerProcess, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": "m", "prompt": text, "add_special_tokens": False},
                   timeout=60)
    return r.json()["tokens"]


def _text(server: ServerProcess, tokens: list[int]) -> str:
    return httpx.post(server.url + "/detokenize", json={"model": "m", "tokens": tokens}, timeout=60).json()["prompt"]


@pytest.mark.parametrize("budget", [0, 3])
def test_the_budget_ends_the_thinking_through_the_api(oai, reasoning_server, budget):
    """The engine closes the section after `budget` reasoning tokens; the bigram model then
    answers as it would after its own </think>."""
    _, server, _ = reasoning_server
    expected = _text(server, _tokens(server, REASONING)[:budget])
    message = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=40,
                                          extra_body={"thinking_token_budget": budget}).choices[0].message
    assert (message.reasoning_content or "") == expected and message.content == ANSWER


def test_structured_output_constrains_only_the_answer(oai):
    """The reasoning stays the model's own free text (a JSON grammar would have refused
    it); the answer after it obeys the schema."""
    schema = {"type": "string", "enum": ["yes", "no"]}
    fields = dict(model="m", messages=HELLO, max_tokens=60,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = oai.chat.completions.create(**fields).choices[0].message
    assert message.reasoning_content == REASONING and message.content in ('"yes"', '"no"')
    capped = oai.chat.completions.create(**fields, extra_body={"thinking_token_budget": 2}).choices[0].message
    assert capped.content in ('"yes"', '"no"') and REASONING.startswith(capped.reasoning_content)


def test_a_completion_with_a_schema_is_constrained_whole(oai):
    """A completion's text is returned unsplit, so its grammar holds from the first token:
    no thinking section is opened before it."""
    text = oai.completions.create(model="m", prompt="<|im_start|>assistant\n", max_tokens=20,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0].text
    assert text in ("yes", "no")
