"""Ollama's API read by the official `ollama` client, on a real server over a tiny bigram
model whose replies are known (tests/reasoning_model.py): a Qwen3-style reasoning reply,
and, when the request has tools, one call of get_weather. Chat and generate streamed and
not, think, tools, format, embed, the listing routes, and bad input answered in Ollama's
error shape with the right status."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import ollama
import pytest

from reasoning_model import ANSWER, QWEN3_TEMPLATE, REASONING, write_chain_model

from .server_process import ServerProcess, start_server

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# Qwen3's template, but with tools the generation prompt ends in <tools>, which the model
# follows with a call.
TEMPLATE = QWEN3_TEMPLATE.replace(
    "{%- if enable_thinking", "{%- if tools %}{{ '<tools>' }}{%- elif enable_thinking")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
HELLO = [{"role": "user", "content": "Hi there"}]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def ollama_server(tmp_path_factory, server_logs) -> Iterator[ServerProcess]:
    folder = write_chain_model(tmp_path_factory.mktemp("ollama-model"), TEMPLATE,
                               ("<think>", "</think>", "<tools>", "<tool_call>", "</tool_call>", CALL),
                               [["\n<think>" + REASONING + "</think>", "\n\n", ANSWER],
                                ["<tools>", "<tool_call>", CALL, "</tool_call>"]])
    proc = start_server(server_logs, "--model", str(folder), "--served-model-name", "m", "--max-model-len",
                        str(MAX_MODEL_LEN))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(ollama_server) -> ollama.Client:
    return ollama.Client(host=ollama_server.url, timeout=60)


@pytest.fixture(scope="module")
def http(ollama_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ollama_server.url, timeout=60) as c:
        yield c


def _check_done(r: ollama.ChatResponse | ollama.GenerateResponse, eval_count: int) -> None:
    assert r.done is True and r.done_reason == "stop" and r.model == "m"
    assert r.eval_count == eval_count and r.prompt_eval_count > 0
    assert r.prompt_eval_duration > 0 and r.eval_duration >= 0 and r.load_duration == 0
    assert abs(r.total_duration - r.prompt_eval_duration - r.eval_duration) <= 1  # nanoseconds of one clock


def test_chat_splits_thinking_and_counts_in_nanoseconds(client):
    r = client.chat(model="m", messages=HELLO, stream=False)
    assert r.message.role == "assistant" and r.message.content == ANSWER and r.message.thinking == REASONING
    assert r.created_at.endswith("Z") and r.message.tool_calls is None
    streamed = list(client.chat(model="m", messages=HELLO, stream=True))
    assert all(not c.done for c in streamed[:-1])
    assert "".join(c.message.content for c in streamed) == ANSWER
    assert "".join(c.message.thinking or "" for c in streamed) == REASONING
    _check_done(r, streamed[-1].eval_count)
    _check_done(streamed[-1], r.eval_count)


def test_think_false_turns_the_templates_thinking_off(client):
    r = client.chat(model="m", messages=HELLO, think=False, stream=False)
    assert r.message.content == ANSWER and r.message.thinking is None


def test_generate_streams_ndjson_by_default(client, http):
    chunks = list(client.generate(model="m", prompt="Hi there", stream=True))
    assert "".join(c.response for c in chunks) == ANSWER and chunks[-1].done
    whole = client.generate(model="m", prompt="Hi there", system="Be brief.", stream=False)
    assert whole.response == ANSWER and whole.thinking == REASONING
    _check_done(whole, chunks[-1].eval_count)
    with http.stream("POST", "/api/generate", json={"model": "m", "prompt": "Hi there"}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    # An empty prompt loads the model and says so, as Ollama does.
    assert client.generate(model="m", prompt="").done_reason == "load"


def test_raw_generate_skips_the_template(client):
    # "\n\n" is where the model answers; raw, that is the whole prompt the model sees.
    r = client.generate(model="m", prompt="\n\n", raw=True, stream=False)
    assert r.response == ANSWER and r.thinking is None
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="m", prompt="\n\n", raw=True, think="low")
    assert e.value.status_code == 400 and "raw prompt" in e.value.error


def test_tools_come_back_in_ollamas_shape(client):
    r = client.chat(model="m", messages=HELLO, tools=TOOLS, stream=False)
    assert r.message.content == "" and r.done_reason == "stop"
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [c for c in client.chat(model="m", messages=HELLO, tools=TOOLS, stream=True) if c.message.tool_calls]
    assert [c.message.tool_calls[0].function.arguments for c in streamed] == [{"city": "Paris"}]
    # The call and its result go back into the conversation in Ollama's shape.
    history = [*HELLO, r.message, {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}]
    assert client.chat(model="m", messages=history, stream=False).done


def test_format_schema_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"],
              "additionalProperties": False}
    r = client.chat(model="m", messages=HELLO, format=schema, think=False, options={"num_predict": 40}, stream=False)
    assert json.loads(r.message.content) == {"city": "Paris"}


def test_options_set_sampling_and_the_context_window(client):
    short = client.chat(model="m", messages=HELLO, options={"num_predict": 2, "temperature": 0, "seed": 1},
                        stream=False)
    assert short.eval_count == 2 and short.done_reason == "length"
    # num_ctx is the request's own window: generation stops where it is full.
    windowed = client.chat(model="m", messages=HELLO, options={"num_ctx": short.prompt_eval_count + 3}, stream=False)
    assert windowed.eval_count == 3 and windowed.done_reason == "length"
    # Ollama's defaults for what this engine does not implement are its own arithmetic: accepted.
    defaults = {"seed": -1, "tfs_z": 1.0, "typical_p": 1, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
                "penalize_newline": True, "num_keep": 4, "num_thread": 2, "f16_kv": True, "repeat_last_n": -1}
    assert client.chat(model="m", messages=HELLO, options=defaults, stream=False).done
    stopped = client.chat(model="m", messages=HELLO, think=False, options={"stop": ["!"]}, stream=False)
    assert stopped.message.content == "Hello"


def test_embed_matches_v1_embeddings(client, http):
    texts = ["Hi there.", "Hello!"]  # each ends in a token of the model's chains: a vector not zero
    r = client.embed(model="m", input=texts)
    assert len(r.embeddings) == 2 and r.prompt_eval_count > 0 and r.model == "m"
    v1 = http.post("/v1/embeddings", json={"model": "m", "input": texts, "encoding_format": "float"})
    assert [d["embedding"] for d in v1.json()["data"]] == [list(e) for e in r.embeddings]
    assert sum(x * x for x in r.embeddings[0]) == pytest.approx(1, abs=1e-5)
    assert len(client.embed(model="m", input=texts[1], dimensions=8).embeddings[0]) == 8
    # The older route answers the vector as the model computes it, not normalised.
    legacy = client.embeddings(model="m", prompt=texts[1]).embedding
    norm = sum(x * x for x in legacy) ** 0.5
    assert norm > 1.5 and [x / norm for x in legacy] == pytest.approx(list(r.embeddings[1]), abs=1e-6)


def test_listing_routes(client, http):
    [tag] = client.list().models
    assert tag.model == "m" and tag.size > 0 and len(tag.digest) == 64 and tag.details.family == "qwen3"
    show = client.show("m")
    assert set(show.capabilities) == {"completion", "embedding", "tools", "thinking"}
    assert show.modelinfo["qwen3.context_length"] == MAX_MODEL_LEN and "<think>" in show.template
    [running] = client.ps().models
    assert running.model == "m" and running.context_length == MAX_MODEL_LEN
    assert http.get("/api/version").json()["version"]


@pytest.mark.parametrize("body, status, message", [
    ({"model": "nope"}, 404, "'nope' does not exist"),
    ({"options": {"mirostat": 2}}, 400, "options.mirostat is not supported"),
    ({"options": {"typical_p": 0.5}}, 400, "options.typical_p is not supported"),
    ({"options": {"tfs_z": 0.9}}, 400, "(only 1: what this server computes)"),
    ({"options": {"penalize_newline": False}}, 400, "options.penalize_newline is not supported"),
    ({"options": {"warp_factor": 9}}, 400, "options.warp_factor is not an option"),
    ({"options": {"num_ctx": MAX_MODEL_LEN + 1}}, 400, "options.num_ctx is 513, beyond"),
    ({"options": {"temperature": -1}}, 400, "options.temperature"),
    ({"options": {"num_predict": 0}}, 400, "options.num_predict must be"),
    ({"options": {"num_predict": 10_000}}, 400, "options.num_predict is 10000"),
    ({"options": {"repeat_last_n": 64}}, 400, "options.repeat_last_n must be -1"),
    ({"format": "yaml"}, 400, "format must be"),
    ({"keep_alive": "soon"}, 400, "keep_alive must be"),
    ({"logprobs": True}, 400, "logprobs are not supported"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ({"messages": "hi"}, 400, "messages"),
])
def test_bad_chat_input_is_answered_in_ollamas_shape(http, body, status, message):
    r = http.post("/api/chat", json={"model": "m", "messages": HELLO, "stream": False, **body})
    assert r.status_code == status and message in r.json()["error"]
    assert set(r.json()) == {"error"}


def test_client_errors_and_unsupported_routes(client, http):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="m", prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    for call in (lambda: client.show("nope"), lambda: client.embed(model="nope", input="x")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404
    for call in (lambda: client.pull("m"), lambda: client.push("m"), lambda: client.copy("m", "n"),
                 lambda: client.delete("m"), lambda: client.create(model="n", from_="m")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and "not supported" in e.value.error
    assert http.post("/api/chat", content=b"{").json()["error"].startswith("the body is not valid JSON")
