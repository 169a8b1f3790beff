"""/v1/responses with the official openai client: text, messages, streaming, JSON schema, tools, stateless."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"]}}


def test_text_input_with_instructions_matches_chat(client, model):
    r = client.responses.create(model=model, input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert r.object == "response" and r.store is False and r.output_text
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_streamed_events_add_up_to_the_response(client, model):
    fields = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
                  max_output_tokens=10, temperature=0, top_p=0.9)
    whole = client.responses.create(**fields)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert kinds.count("response.output_text.delta") > 1 and text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and events[-1].response.output_text == text


def test_text_format_json_schema(client, model):
    r = client.responses.create(model=model, input="Describe a person as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_and_its_output(client, model, http, stream):
    fields = dict(model=model, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    if stream:
        events = list(client.responses.create(**fields, stream=True))
        pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
        assert pieces == response.output[0].arguments
    else:
        response = client.responses.create(**fields)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    # The call and its output go back as input items; nothing is kept on the server.
    answer = client.responses.create(model=model, max_output_tokens=12, temperature=0, tools=[WEATHER_TOOL],
                                     tool_choice="none", input=[
                                         {"role": "user", "content": "What is the weather in Paris?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": '{"sky": "sunny"}'}])
    # The items became the chat turns they stand for: the same prompt as this chat conversation.
    tokens = http.post("/tokenize", json={"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}]}).json()["tokens"]
    assert answer.output_text and answer.usage.input_tokens == len(tokens)


@pytest.mark.parametrize("fields, param, message", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input", "input_text"),
    ({"tools": [{"type": "web_search"}]}, "tools", "not supported"),
    ({"tools": [{**WEATHER_TOOL, "parameters": {"type": "objekt"}}]}, "tools", "objekt"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: Input should be greater than or equal to 1"),
])
def test_bad_requests_are_400_naming_the_responses_field(client, model, fields, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": model, "input": "hi", "max_output_tokens": 4, **fields})
    error = info.value.body
    assert error["param"] == param and message in error["message"], error
