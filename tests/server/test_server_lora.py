"""Multi-LoRA serving over HTTP: `model` picks an adapter, /v1/models lists them, and
adapters load and unload at run time behind the API key, refusing to unload one that
unfinished requests run.

The adapters' numerics against transformers + peft are tests/test_lora.py's; here the
server must route each request to its adapter (outputs differ from the base model's
and do not depend on what else is in the batch) and leak no KV block.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.bench.lora_adapters import write_random_adapter
from pagedserve.model.loader import convert_gguf
from pagedserve.model.registry import default_model_path

from .server_process import start_server

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    config = convert_gguf(default_model_path()).config
    root = tmp_path_factory.mktemp("server-adapters")
    specs = {"all8": (8, None), "qv4": (4, ("q_proj", "v_proj")), "mlp8": (8, ("gate_proj", "up_proj", "down_proj")),
             "wide": (32, ("q_proj",))}
    return {name: str(write_random_adapter(root / name, config, rank=r, alpha=2 * r, seed=i, b_std=0.1,
                                           **({"targets": t} if t else {})))
            for i, (name, (r, t)) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def lora_server(server_logs, adapters):
    proc = start_server(server_logs, "--enable-lora", "--lora-modules", f"all8={adapters['all8']}",
                        "--max-loras", "2", "--max-lora-rank", "16", "--api-key", KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=120, headers=AUTH) as client:
        yield client


def complete(http: httpx.Client, model: str | None, max_tokens: int = 12) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = http.post("/v1/completions", json=body if model is None else {**body, "model": model})
    assert r.status_code == 200, r.text
    return r.json()


def first_logprob(reply: dict) -> float:
    return reply["choices"][0]["logprobs"]["token_logprobs"][0]


def kv_usage(http: httpx.Client) -> str:
    return next(line for line in http.get("/metrics").text.splitlines()
                if line.startswith("pagedserve:kv_cache_usage_perc{"))


def test_models_lists_the_adapters_with_their_parent(http, lora_server, adapters):
    data = http.get("/v1/models").json()["data"]
    base, adapter = data
    assert base["parent"] is None and adapter["id"] == "all8"
    assert adapter["parent"] == base["id"] and adapter["root"] == adapters["all8"]
    assert httpx.get(lora_server.url + "/v1/models").status_code == 401


def test_model_picks_the_adapter_in_a_shared_batch(http):
    base, lora = complete(http, None), complete(http, "all8")
    assert lora["model"] == "all8"
    # The adapter runs: even where it keeps the greedy token, its probabilities move.
    assert first_logprob(lora) != first_logprob(base)
    expected = {None: base["choices"][0]["text"], "all8": lora["choices"][0]["text"]}
    models = [None, "all8"] * 4
    with ThreadPoolExecutor(len(models)) as pool:  # concurrent: the engine batches them together
        replies = list(pool.map(lambda m: complete(http, m), models))
    assert [r["choices"][0]["text"] for r in replies] == [expected[m] for m in models]
    chat = http.post("/v1/chat/completions", json={"model": "all8", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "all8"
    missing = http.post("/v1/completions", json={"model": "nope", "prompt": "a", "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(http, lora_server, adapters):
    assert httpx.post(lora_server.url + "/v1/load_lora_adapter",
                      json={"lora_name": "qv4", "lora_path": adapters["qv4"]}).status_code == 401

    def load_error(name: str, path: str) -> tuple[int, str]:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        return r.status_code, r.json()["error"]["message"]

    # One slot is free: these fail on the adapter itself.
    status, message = load_error("ghost", "/nonexistent/adapter")
    assert status == 400 and "is not a PEFT adapter folder" in message
    status, message = load_error("wide", adapters["wide"])
    assert status == 400 and "above max_lora_rank (16)" in message
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "qv4", "lora_path": adapters["qv4"]})
    assert r.status_code == 200, r.text
    assert [m["id"] for m in http.get("/v1/models").json()["data"]][1:] == ["all8", "qv4"]
    assert first_logprob(complete(http, "qv4")) != first_logprob(complete(http, None))
    assert load_error("qv4", adapters["qv4"]) == (400, "the name 'qv4' is already served")
    status, message = load_error("mlp8", adapters["mlp8"])
    assert status == 400 and "max_loras (2)" in message
    assert http.post("/v1/load_lora_adapter", json={"lora_name": ""}).status_code == 400
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404

    # Unloading an adapter that a running request uses is refused until it finishes.
    body = {"model": "qv4", "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "qv4"
        busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv4", "lora_path": adapters["qv4"]})
        assert busy.status_code == 400 and "unfinished requests" in busy.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv4", "lora_path": adapters["qv4"]})
    assert r.status_code == 200, r.text
    gone = http.post("/v1/completions", json={"model": "qv4", "prompt": "a", "max_tokens": 1})
    assert gone.status_code == 404
    # The freed slot takes another adapter; nothing is left holding KV blocks.
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "mlp8", "lora_path": adapters["mlp8"]}).status_code == 200
    complete(http, "mlp8")
    assert kv_usage(http).endswith(" 0.0")
