"""Several models in one server (docs/multi-model.md): two tiny bigram models that answer
"Alpha" and "Bravo", a third (from a models config, with an alias and its own context
length) for the concurrent first load, a's model again with task=generate, and a folder
that fails to load, served with --max-loaded-models 1. A request's `model` picks the engine, a model
loads on first use (once, however many requests ask at the same time), the least
recently used idle one is unloaded to make room, a failed model is marked failed while
the others serve, and vLLM's sleep routes and Ollama's keep_alive move the states."""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import pytest

from reasoning_model import write_chain_model

from .server_process import ServerProcess, start_server

TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
REPLIES = {"a": "Alpha", "b": "Bravo", "c": "Charlie"}


@pytest.fixture(scope="module")
def models_server(tmp_path_factory, server_logs) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("models")
    flags = []
    folders = {name: write_chain_model(root / name, TEMPLATE, (), [["\n" + reply]]) for name, reply in REPLIES.items()}
    for name in ("a", "b"):
        flags += ["--model", f"{name}={folders[name]}"]
    # c comes from a models config: an alias and its own context length.
    config = root / "models.yaml"
    config.write_text(f"models:\n  c:\n    path: {folders['c']}\n    aliases: [charlie]\n"
                      "    options: {max_model_len: 64}\n"
                      f"  gen:\n    path: {folders['a']}\n    options: {{task: generate}}\n")
    proc = start_server(server_logs, *flags, "--models-dir", str(_dir_with_broken(root)), "--models-config",
                        str(config), "--max-loaded-models", "1", "--max-model-len", "128")
    yield proc
    proc.stop()


def _dir_with_broken(root: Path) -> Path:
    """A --models-dir holding one model folder, which fails to load (no weights)."""
    folder = root / "more"
    (folder / "broken").mkdir(parents=True)
    (folder / "broken" / "config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def http(models_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=models_server.url, timeout=120) as c:
        yield c


def _chat(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 5})


def _states(http: httpx.Client) -> dict[str, str]:
    return {card["id"]: card["state"] for card in http.get("/v1/models").json()["data"]}


def test_the_request_model_picks_the_engine_and_the_lru_one_is_unloaded(http):
    assert _states(http) == {"a": "unloaded", "b": "unloaded", "broken": "unloaded", "c": "unloaded",
                             "gen": "unloaded"}
    for model, loaded in (("a", "a"), ("b", "b"), ("a", "a")):
        r = _chat(http, model)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLIES[model]
        assert r.json()["model"] == model
        # --max-loaded-models 1: loading one unloaded the other, which sat idle.
        assert {m for m, state in _states(http).items() if state == "loaded"} == {loaded}
    assert http.post("/v1/chat/completions", json={"model": "z", "messages": [{"role": "user", "content": "x"}]}
                     ).status_code == 404
    tags = {t["name"]: t for t in http.get("/api/tags").json()["models"]}
    assert tags["a"]["state"] == "loaded" and tags["b"]["state"] == "unloaded" and tags["a"]["size"] > 0
    assert [m["name"] for m in http.get("/api/ps").json()["models"]] == ["a"]


def test_concurrent_first_requests_load_the_model_once(http, models_server):
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: _chat(http, "charlie" if i % 2 else "c"), range(6)))
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == [REPLIES["c"]] * 6
    assert {r.json()["model"] for r in replies} == {"c"}
    assert models_server.log().count("loading model c from") == 1
    [card] = [c for c in http.get("/v1/models").json()["data"] if c["id"] == "c"]
    assert card["aliases"] == ["charlie"] and card["max_model_len"] == 64  # its own options


def test_a_model_that_fails_to_load_is_marked_failed_and_the_others_serve(http):
    r = _chat(http, "broken")
    assert r.status_code == 503 and "'broken' failed to load" in r.json()["error"]["message"]
    [card] = [c for c in http.get("/v1/models").json()["data"] if c["id"] == "broken"]
    assert card["state"] == "failed" and "not found" in card["reason"]
    assert _chat(http, "b").json()["choices"][0]["message"]["content"] == REPLIES["b"]
    assert ollama.Client(host=str(http.base_url)).list().models  # the listing keeps answering


def test_sleep_and_wake_up(http):
    assert _chat(http, "b").status_code == 200
    assert http.post("/sleep", params={"model": "b", "level": 1}).status_code == 200
    assert http.get("/is_sleeping", params={"model": "b"}).json() == {"is_sleeping": True}
    [card] = [c for c in http.get("/v1/models").json()["data"] if c["id"] == "b"]
    assert card["state"] == "sleeping" and card["sleep_level"] == 1
    assert http.post("/wake_up", params={"model": "b"}).status_code == 200
    assert _states(http)["b"] == "loaded" and not http.get("/is_sleeping", params={"model": "b"}).json()["is_sleeping"]
    assert http.post("/sleep", params={"model": "b", "level": 2}).status_code == 200
    assert _states(http)["b"] == "sleeping"
    # A request for a sleeping model wakes it.
    assert _chat(http, "b").json()["choices"][0]["message"]["content"] == REPLIES["b"]
    assert _states(http)["b"] == "loaded"
    assert http.post("/sleep", params={"model": "b", "level": 3}).json()["error"]["param"] == "level"
    assert http.post("/sleep", params={"model": "nope"}).status_code == 404


def test_ollama_keep_alive_unloads_or_keeps(http):
    client = ollama.Client(host=str(http.base_url), timeout=120)
    r = client.chat(model="a", messages=[{"role": "user", "content": "hi"}], keep_alive="1h")
    assert r.message.content == REPLIES["a"]
    [running] = client.ps().models
    assert running.model == "a" and running.expires_at is not None
    client.chat(model="a", messages=[{"role": "user", "content": "hi"}], keep_alive=0)
    # Unloaded as the request ends, which is just after the client has read the reply.
    deadline = time.monotonic() + 30
    while _states(http)["a"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _states(http)["a"] == "unloaded" and client.ps().models == []
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="a", messages=[{"role": "user", "content": "hi"}], keep_alive="soon")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error


def test_ollama_embed_needs_an_engine_that_embeds(http):
    # gen is a's model with its own option task=generate (the models config).
    r = http.post("/api/embed", json={"model": "gen", "input": "hi"})
    assert r.status_code == 400 and "task 'generate'" in r.json()["error"]
    assert ollama.Client(host=str(http.base_url)).chat(model="gen", messages=[{"role": "user", "content": "hi"}]
                                                       ).message.content == REPLIES["a"]
    assert len(ollama.Client(host=str(http.base_url)).embed(model="a", input="hi").embeddings) == 1
