"""Every route against servers started in other engine shapes: none answers 5xx, none
stops the engine, and a route the shape cannot serve says why with a 4xx.

(The contiguous layout once crashed the engine thread on GET /v1/kv_events: it has no
block pool, and the feed read one.)
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from .api_fuzz import FUZZ_SERVER_FLAGS, UNFUZZED, fuzz_operation, load_schema
from .server_process import ENGINE_SHAPES, ServerProcess, start_server

MODEL = "SmolLM2-135M-Instruct"
FUZZ_EXAMPLES = 3
# (method, path, JSON body) for every route; streams are read for their first bytes.
PROBES = [
    ("GET", "/health", None),
    ("GET", "/version", None),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/tokenizer_info", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3}),
    ("POST", "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("POST", "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                              "stream": True}),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/v1/kv_events", None),
    ("GET", "/dashboard", None),
    ("GET", "/dashboard/events", None),
    ("POST", "/dashboard/speculation", {"enabled": False}),
    ("POST", "/dashboard/speculation", {"enabled": True}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
]
SHAPES = ENGINE_SHAPES


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped_server(request, server_logs) -> Iterator[ServerProcess]:
    # The fuzzing flags: a 40-token context keeps every generated request short.
    proc = start_server(server_logs, *FUZZ_SERVER_FLAGS, *SHAPES[request.param])
    yield proc
    proc.stop()


def probe(client: httpx.Client, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
    with client.stream(method, path, json=body) as response:
        first = next(response.iter_bytes(), b"")  # an event stream: its first bytes are enough
        return response.status_code, first


def test_every_route_answers_without_5xx_and_the_engine_lives_on(shaped_server):
    # A few schemathesis cases (schema-valid and not) on every operation this shape's
    # document lists (`make fuzz` sends thousands per shape), then each route by hand.
    from schemathesis import GenerationMode

    for result in load_schema(shaped_server.url).get_all_operations():
        operation = result.ok()
        if operation.label in UNFUZZED or not operation.label.startswith("POST"):
            continue
        for mode in GenerationMode:
            run = fuzz_operation(operation, shaped_server.url, mode, FUZZ_EXAMPLES, seed=3)
            assert all(status < 500 for status in run.statuses), (operation.label, mode, run.statuses)
            assert not run.failures, "\n".join(run.failures)
    with httpx.Client(base_url=shaped_server.url, timeout=30) as client:
        for method, path, body in PROBES:
            status, first = probe(client, method, path, body)
            assert status < 500, (method, path, status, first[:300])
            assert client.get("/health").status_code == 200, (method, path, shaped_server.log()[-2000:])
        # Still serving, not just alive.
        reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200
    assert shaped_server.proc.poll() is None


@pytest.mark.parametrize("shaped_server", ["contiguous"], indirect=True)
def test_kv_events_on_the_contiguous_layout_say_why_not(shaped_server):
    reply = httpx.get(shaped_server.url + "/v1/kv_events", timeout=30)
    assert reply.status_code == 400
    assert "contiguous" in reply.json()["error"]["message"]
    assert httpx.get(shaped_server.url + "/health", timeout=30).status_code == 200
