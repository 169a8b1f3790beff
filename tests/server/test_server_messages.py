"""/v1/messages with the official anthropic client: text, streaming, stop sequences, tools, errors.

This client version has no sampling arguments, so temperature and friends go in extra_body.
"""
from __future__ import annotations

import json
import threading

import anthropic
import jsonschema
import pytest

from .faulty_server import FAIL_STEP_ENV
from .server_process import start_server

GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_text_matches_chat(claude, client, model):
    m = claude.messages.create(model=model, max_tokens=12, system="Answer in one word.",
                               messages=[{"role": "user", "content": "Name a colour."}], **GREEDY)
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == model
    [block] = m.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert m.stop_sequence is None


def test_stream_events_add_up_to_the_message(claude, model):
    fields = dict(model=model, max_tokens=16, messages=[{"role": "user", "content": "Say hello."}],
                  extra_body={"temperature": 0, "top_p": 0.9, "top_k": 40})
    whole = claude.messages.create(**fields)
    events = list(claude.messages.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 6
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == whole.usage.input_tokens
    assert events[1].index == 0 and events[1].content_block.type == "text"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(claude, client, model):
    fields = dict(model=model, max_tokens=40, messages=[{"role": "user", "content": "Count from 1 to 10."}])
    m = claude.messages.create(**fields, stop_sequences=["5", "never"], **GREEDY)
    chat = client.chat.completions.create(**fields, stop=["5", "never"], temperature=0)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "5"
    assert m.content[0].text == chat.choices[0].message.content and "5" not in m.content[0].text


def test_text_blocks_render_as_chat_content_parts(claude, model, http):
    blocks = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    system = [{"type": "text", "text": "Be brief."}]
    m = claude.messages.create(model=model, max_tokens=4, system=system, messages=[{"role": "user", "content": blocks}],
                               **GREEDY)
    tokens = http.post("/tokenize", json={"messages": [{"role": "system", "content": system},
                                                       {"role": "user", "content": blocks}]}).json()["tokens"]
    assert m.usage.input_tokens == len(tokens)
    counted = claude.messages.count_tokens(model=model, system=system, messages=[{"role": "user", "content": blocks}])
    assert counted.input_tokens == len(tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_and_its_result(claude, model, http, stream):
    fields = dict(model=model, max_tokens=60, messages=QUESTION, tools=[WEATHER_TOOL],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    if stream:
        with claude.messages.stream(**fields) as events:
            pieces = "".join(e.delta.partial_json for e in events
                             if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
            m = events.get_final_message()
        assert json.loads(pieces) == m.content[0].input
    else:
        m = claude.messages.create(**fields)
    assert m.stop_reason == "tool_use"
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    assert claude.messages.count_tokens(model=model, messages=QUESTION, tools=[WEATHER_TOOL],
                                        tool_choice={"type": "any"}).input_tokens == m.usage.input_tokens
    # The call goes back in an assistant turn and its result in a user turn: the prompt is
    # the chat conversation they stand for.
    conversation = [*QUESTION, {"role": "assistant", "content": m.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": '{"sky": "sunny"}'}]}]
    answer = claude.messages.create(model=model, max_tokens=12, messages=conversation, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "none"}, **GREEDY)
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    tokens = http.post("/tokenize", json={"messages": [
        *QUESTION,
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                              "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]}).json()["tokens"]
    assert answer.usage.input_tokens == len(tokens)


def test_named_tool_choice(claude, model):
    add = {"name": "add", "description": "Add two integers", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
    m = claude.messages.create(model=model, max_tokens=60, messages=QUESTION, tools=[WEATHER_TOOL, add],
                               tool_choice={"type": "tool", "name": "add"}, **GREEDY)
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "add")]
    jsonschema.validate(m.content[0].input, add["input_schema"])


def test_output_config_format_is_a_json_schema_the_reply_follows(claude, model):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    m = claude.messages.create(model=model, max_tokens=40, messages=[{"role": "user", "content": "Describe a person."}],
                               output_config={"format": {"type": "json_schema", "schema": person}}, **GREEDY)
    jsonschema.validate(json.loads(m.content[0].text), person)


def test_a_final_assistant_turn_is_continued(claude, model, http):
    prefill = '{"colour": "'
    messages = [{"role": "user", "content": "Name a colour as JSON."}, {"role": "assistant", "content": prefill}]
    m = claude.messages.create(model=model, max_tokens=8, messages=messages, **GREEDY)
    # The same prompt through /v1/completions: the chat prompt's text, then the prefill.
    chat_prompt = http.post("/tokenize", json={"messages": messages[:1]}).json()["tokens"]
    prompt = http.post("/detokenize", json={"tokens": chat_prompt}).json()["prompt"] + prefill
    completion = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert m.content[0].text == completion["choices"][0]["text"]
    assert m.usage.input_tokens == completion["usage"]["prompt_tokens"] > len(chat_prompt)
    assert claude.messages.count_tokens(model=model, messages=messages).input_tokens == m.usage.input_tokens


def test_streamed_blocks_close_before_the_next_opens():
    from pagedserve.entrypoints.openai.serving_messages import _StreamedBlocks
    from pagedserve.http.tool_parsers import ToolCallDelta

    blocks = _StreamedBlocks()
    sent = blocks.text("Let me look.") + blocks.text("") + blocks.calls([
        ToolCallDelta(0, '{"city": ', "call_1", "get_weather"), ToolCallDelta(0, '"Paris"}'),
        ToolCallDelta(1, "{}", "call_2", "now")]) + blocks.text("Done.") + blocks.close() + blocks.close()
    events = [json.loads(event.split("data: ", 1)[1]) for event in sent]
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2), ("content_block_start", 3), ("content_block_delta", 3),
        ("content_block_stop", 3)]
    assert events[3]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[4:6]) == '{"city": "Paris"}'
    assert all(event.startswith(f"event: {e['type']}\n") for event, e in zip(sent, events))


USER = {"role": "user", "content": "hi"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": None}, "max_tokens: Field required"),
    ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role: Input should be 'user' or 'assistant'"),
    ({"messages": [{"role": "assistant", "content": "hi"}, USER]}, "a conversation starts with a user turn"),
    ({"messages": [USER, {"role": "assistant", "content": "Sure "}]}, "cannot end with trailing whitespace"),
    ({"messages": [USER, {"role": "assistant", "content": [CALL]}]}, "may hold only text blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "image.source: Unable to extract tag using discriminator 'type'"),
    ({"messages": [{"role": "user", "content": [CALL]}]}, "tool_use blocks belong in assistant turns"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}, USER]},
     "tool_result blocks belong in user turns"),
    ({"messages": [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]}]}, "'toolu_2' answers no tool_use"),
    ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
    ({"stop_sequences": [""]}, "stop_sequences[0]: String should have at least 1 character"),
    ({"tool_choice": {"type": "any"}}, "tool_choice is only allowed when tools are given"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type: Input should be 'custom'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among the tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]}, "tools[0].input_schema is not a valid JSON schema"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}, "output_config": {"format": {
        "type": "json_schema", "schema": WEATHER}}}, "cannot be combined with output_config.format"),
    ({"max_tokens": 5000}, "maximum context length"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema: Field required"),
])
def test_bad_requests_are_invalid_request_errors(claude, model, fields, message):
    body = {"model": model, "max_tokens": 4, "messages": [USER], **fields}
    # The client's raw post: its typed create() needs max_tokens and a valid role.
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.post("/v1/messages", cast_to=object, body={k: v for k, v in body.items() if v is not None})
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert message in info.value.body["error"]["message"], info.value.body


def test_errors_take_anthropic_shape_only_on_its_routes(claude, http):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=[USER])
    assert info.value.body["error"]["type"] == "not_found_error"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = http.post(path, content=b"{")
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/v1/messages").json()["type"] == "error"  # 405 from routing
    with pytest.raises(anthropic.APIStatusError) as info:  # 413 from the body limit, before any route
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x" * (5 << 20)}])
    assert info.value.status_code == 413 and info.value.body["error"]["type"] == "request_too_large"
    r = http.post("/v1/chat/completions", content=b"{")
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] is None


def test_an_engine_crash_is_an_api_error_streamed_or_not(server_logs):
    # Greedy, this prompt runs for 120 tokens: step 25 fails both requests mid-generation.
    server = start_server(server_logs, env={FAIL_STEP_ENV: "25"}, entry="tests.server.faulty_server")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    fields = dict(model="SmolLM2-135M-Instruct", max_tokens=200, **GREEDY,
                  messages=[{"role": "user", "content": "Count from 1 to 500, one number per line."}])
    errors: dict[str, anthropic.APIStatusError] = {}
    kinds: list[str] = []

    def stream() -> None:
        try:
            for event in claude.messages.create(**fields, stream=True):
                kinds.append(event.type)
        except anthropic.APIStatusError as e:
            errors["stream"] = e

    thread = threading.Thread(target=stream)
    thread.start()
    with pytest.raises(anthropic.InternalServerError) as info:
        claude.messages.create(**fields)
    thread.join(60)
    assert info.value.status_code == 500 and info.value.body["error"]["type"] == "api_error"
    assert "content_block_delta" in kinds and "message_stop" not in kinds  # cut mid-stream...
    assert errors["stream"].body["error"]["type"] == "api_error"  # ...by an error event
    assert server.proc.wait(timeout=30) == 1
