"""gpt-oss's harmony format through every API, read by the official openai and anthropic
clients: two tiny harmony models (tests/harmony_model.py), one that reasons then answers,
one that reasons then calls a tool; the chat template is harmony's own, so the server
detects the gpt_oss parser from it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from harmony_model import (ANSWER, ANSWER_MODEL, CALL_ARGUMENTS, CALL_MODEL, CALL_NAME, CALL_REASONING, REASONING,
                           WEATHER_TOOL, tokens_of, write_harmony_model)

from .server_process import ServerProcess, start_server

HELLO = [{"role": "user", "content": "Hi there"}]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
ANALYSIS_SECTION = "<|channel|>analysis<|message|>{}<|end|>"


def _serve(folder: Path, server_logs: Path) -> ServerProcess:
    return start_server(server_logs, "--model", str(folder), "--max-model-len", "4096", "--served-model-name", "m")


@pytest.fixture(scope="module")
def answer_server(tmp_path_factory, server_logs) -> Iterator[tuple[ServerProcess, Path]]:
    folder = write_harmony_model(tmp_path_factory.mktemp("answer"), ANSWER_MODEL)
    proc = _serve(folder, server_logs)
    yield proc, folder
    proc.stop()


@pytest.fixture(scope="module")
def call_server(tmp_path_factory, server_logs) -> Iterator[tuple[ServerProcess, Path]]:
    folder = write_harmony_model(tmp_path_factory.mktemp("call"), CALL_MODEL)
    proc = _serve(folder, server_logs)
    yield proc, folder
    proc.stop()


def _openai(server: tuple[ServerProcess, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _anthropic(server: tuple[ServerProcess, Path]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0].url, api_key="unused", max_retries=0, timeout=60)


def test_chat_splits_analysis_from_final(answer_server):
    r = _openai(answer_server).chat.completions.create(model="m", messages=HELLO, max_tokens=60)
    message = r.choices[0].message
    assert message.reasoning_content == REASONING and message.content == ANSWER
    assert r.choices[0].finish_reason == "stop"  # on <|return|>, not on the analysis' <|end|>
    expected = tokens_of(answer_server[1], ANALYSIS_SECTION.format(REASONING))
    assert r.usage.completion_tokens_details.reasoning_tokens == expected


def test_chat_stream_with_usage(answer_server):
    chunks = list(_openai(answer_server).chat.completions.create(
        model="m", messages=HELLO, max_tokens=60, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    expected = tokens_of(answer_server[1], ANALYSIS_SECTION.format(REASONING))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected


def test_reasoning_effort_reaches_the_system_message(answer_server):
    """The effort is written into harmony's system message: the prompt grows by nothing
    but the word (medium is the default)."""
    client = _openai(answer_server)
    sizes = {effort: client.chat.completions.create(model="m", messages=HELLO, max_tokens=60,
                                                    reasoning_effort=effort).usage.prompt_tokens
             for effort in ("low", "medium", "high")}
    default = client.chat.completions.create(model="m", messages=HELLO, max_tokens=60).usage.prompt_tokens
    assert sizes["medium"] == default
    server = answer_server[0]
    rendered = {effort: httpx.post(server.url + "/tokenize", timeout=60, json={
        "model": "m", "messages": HELLO, "chat_template_kwargs": {"reasoning_effort": effort}}).json()["count"]
        for effort in ("low", "high")}
    assert rendered == {"low": sizes["low"], "high": sizes["high"]}


def test_responses_reasoning_item(answer_server):
    r = _openai(answer_server).responses.create(model="m", input="Hi there", max_output_tokens=60)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output_text == ANSWER


def test_messages_thinking_and_text(answer_server):
    claude = _anthropic(answer_server)
    m = claude.messages.create(model="m", max_tokens=2000, messages=HELLO,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
        [("thinking", REASONING), ("text", ANSWER)]


def test_chat_tool_call_from_commentary(call_server):
    r = _openai(call_server).chat.completions.create(model="m", messages=WEATHER, tools=[WEATHER_TOOL],
                                                     max_tokens=60)
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (CALL_NAME, CALL_ARGUMENTS)
    assert choice.message.reasoning_content == CALL_REASONING and choice.message.content is None
    assert choice.finish_reason == "tool_calls"  # stopped on <|call|>


def test_chat_tool_call_streamed(call_server):
    chunks = list(_openai(call_server).chat.completions.create(model="m", messages=WEATHER, tools=[WEATHER_TOOL],
                                                               max_tokens=60, stream=True))
    pieces = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == CALL_NAME and pieces[0].id.startswith("call_")
    assert "".join(p.function.arguments or "" for p in pieces) == CALL_ARGUMENTS
    assert {p.index for p in pieces} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


def test_without_tools_the_call_stays_text(call_server):
    message = _openai(call_server).chat.completions.create(model="m", messages=WEATHER,
                                                           max_tokens=60).choices[0].message
    assert message.tool_calls is None and message.content == CALL_ARGUMENTS


def test_a_tool_round_trip_renders(call_server):
    """The call and its result go back into the prompt in harmony's form (no 400)."""
    client = _openai(call_server)
    first = client.chat.completions.create(model="m", messages=WEATHER, tools=[WEATHER_TOOL], max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    turns = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    again = client.chat.completions.create(model="m", messages=turns, tools=[WEATHER_TOOL], max_tokens=60)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    assert again.choices[0].message.tool_calls[0].function.name == CALL_NAME


def test_forced_tool_choice_is_refused(call_server):
    with pytest.raises(openai.BadRequestError) as e:
        _openai(call_server).chat.completions.create(model="m", messages=WEATHER, tools=[WEATHER_TOOL],
                                                     tool_choice="required", max_tokens=60)
    assert e.value.body["param"] == "tool_choice" and "harmony" in e.value.body["message"]


def test_responses_function_call_item(call_server):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    r = _openai(call_server).responses.create(model="m", input="Weather in Paris?", tools=[tool],
                                              max_output_tokens=60)
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    assert (r.output[1].name, r.output[1].arguments) == (CALL_NAME, CALL_ARGUMENTS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_tool_use_block(call_server, stream):
    tool = {"name": CALL_NAME, "description": "The weather in a city.",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    claude = _anthropic(call_server)
    fields = dict(model="m", max_tokens=60, messages=WEATHER, tools=[tool])
    if stream:
        with claude.messages.stream(**fields) as events:
            m = events.get_final_message()
    else:
        m = claude.messages.create(**fields)
    [block] = m.content
    assert (block.type, block.name, block.input) == ("tool_use", CALL_NAME, json.loads(CALL_ARGUMENTS))
    assert m.stop_reason == "tool_use"
