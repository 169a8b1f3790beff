"""Structured output over HTTP: OpenAI's response_format and vLLM's guided_* /
structured_outputs fields on both endpoints; a bad schema, regex or grammar is a 400
naming its field, and the server keeps serving."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from .test_server_validation import CHAT, COMPLETIONS, FUZZ_VALUES, assert_openai_error


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120}}}
MESSAGES = [{"role": "user", "content": "Describe a person in JSON."}]


def test_openai_client_json_schema_response_format(client, model):
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_response_format_streamed(http):
    body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_response_format(http):
    # The 135M model rarely closes a free-form object within a short budget, but
    # unconstrained it answers in prose: an object's opening shows the constraint holds.
    r = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                              "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith('{"')


@pytest.mark.parametrize("fields, check", [
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
     lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
])
def test_vllm_fields_on_completions(http, fields, check):
    r = http.post(COMPLETIONS, json={"prompt": "Answer: ", "max_tokens": 48, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_guided_choice_on_chat_with_n(http):
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Yes or no?"}], "n": 3, "temperature": 1.0,
                              "seed": 3, "max_tokens": 8, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    assert all(c["message"]["content"] in ("yes", "no") and c["finish_reason"] == "stop"
               for c in r.json()["choices"])


@pytest.mark.parametrize("path, fields, param, message", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format", "xml"),
    (COMPLETIONS, {"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    (COMPLETIONS, {"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
    (COMPLETIONS, {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (COMPLETIONS, {"guided_choice": []}, "guided_choice", "choice"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs", "exactly one"),
    (COMPLETIONS, {"structured_outputs": {"lark": "x"}}, "structured_outputs", "takes only"),
    (COMPLETIONS, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "at most one"),
])
def test_bad_constraint_is_a_400_and_the_server_keeps_serving(http, path, fields, param, message):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    r = http.post(path, json={**body, "max_tokens": 4, **fields})
    assert_openai_error(r, 400, param)
    assert message in r.json()["error"]["message"]
    ok = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "guided_choice": ["ok"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"


def test_no_5xx_for_odd_response_formats(http):
    odd = [*FUZZ_VALUES, {"type": None}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": []},
           {"type": "json_schema", "json_schema": {"schema": "x"}}, {"type": "json_schema", "json_schema": {"schema": {
               "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]
    for value in odd:
        r = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1, "response_format": value})
        assert r.status_code < 500, (value, r.text)
        if r.status_code >= 400:
            assert_openai_error(r, r.status_code, "response_format")
