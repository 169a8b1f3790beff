"""Tool calling on /v1/chat/completions with the official openai client (hermes format)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_always_yields_calls_valid_against_the_schema(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, n=3, temperature=1.0, seed=7, max_tokens=60)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])


def test_named_function_and_round_trip(client, model, http):
    r = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    _check_call(call)
    conversation = [*QUESTION, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=model, messages=conversation, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=24)
    message = answer.choices[0].message
    assert message.tool_calls is None and message.content
    # The prompt the model answered holds its call and the tool's result.
    tokens = http.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    assert answer.usage.prompt_tokens == len(tokens)
    prompt = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in prompt
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in prompt


def test_streamed_deltas_reassemble_to_the_non_streamed_calls(client, model):
    fields = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60,
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**fields).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    pieces = 0
    finish = None
    for chunk in client.chat.completions.create(**fields, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or []:
            pieces += 1
            entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces > 2  # the arguments came in several pieces
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_falls_back_to_plain_content(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       tools=TOOLS, temperature=0, max_tokens=12)
    message = r.choices[0].message
    assert message.tool_calls is None and message.content and "<tool_call>" not in message.content


@pytest.mark.parametrize("fields, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "objekt"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]}, "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "1-64 letters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "only allowed when tools are given"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "not valid JSON"),
])
def test_bad_tools_are_400_in_openai_shape(client, model, fields, message):
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert message in error["message"] and error["param"] in ("tools", "tool_choice", "messages")


def test_parallel_tool_calls_are_each_valid(client, model):
    """With parallel_tool_calls (the default) the grammar admits one call or more; every
    one parses, validates and has its own id."""
    r = client.chat.completions.create(
        model=model, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=3, max_tokens=200,
        messages=[{"role": "user", "content": "What is the weather in Paris and in Rome, and what is 2 + 3?"}])
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        for call in calls:
            _check_call(call)
        assert len({c.id for c in calls}) == len(calls)
        assert choice.finish_reason == "tool_calls"
