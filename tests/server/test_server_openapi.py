"""The server publishes an exact OpenAPI document, and schemathesis finds nothing in it.

The document is generated from the models that parse the requests, so a bound in the
schema is a bound the server enforces; the property-based run below sends a few hundred
schema-valid and schema-invalid bodies to every operation (`make fuzz` sends 10,000).
"""
from __future__ import annotations

import os

import httpx
import jsonschema
import pytest

from pagedserve.http.anthropic_bodies import CountTokensRequest, MessagesRequest
from pagedserve.http.errors import ANTHROPIC_PATHS, OLLAMA_PATH_PREFIX
from pagedserve.http.openapi import REQUEST_MODELS
from pagedserve.http.pooling_bodies import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedserve.http.openai_bodies import MAX_STOP_STRINGS
from pagedserve.sampling_params import MAX_ABS_PENALTY, MAX_LOGPROBS

from .api_fuzz import FUZZ_SERVER_FLAGS, UNFUZZED, fuzz_operation, load_schema, summary
from .server_process import start_server

# Per operation and generation mode (positive + negative: twice this per operation).
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "60"))  # `make fuzz` runs 10,000
ROUTES = {("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/v1/responses"),
          ("get", "/v1/models"), ("post", "/tokenize"), ("post", "/detokenize"), ("get", "/tokenizer_info"),
          ("get", "/health"), ("get", "/metrics"), ("get", "/version"), ("get", "/v1/kv_events"),
          ("get", "/dashboard"), ("get", "/dashboard/events"), ("post", "/dashboard/speculation"),
          ("post", "/v1/messages"), ("post", "/v1/messages/count_tokens"), ("post", "/v1/embeddings"),
          ("post", "/v1/score"), ("post", "/v1/rerank")}
LORA_ROUTES = {("post", "/v1/load_lora_adapter"), ("post", "/v1/unload_lora_adapter")}


@pytest.fixture(scope="module")
def document(http) -> dict:
    r = http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _variant(schema: dict, key: str) -> dict:
    """The non-null member of an optional field's anyOf (or the schema itself)."""
    return next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null" and key in s), schema)


def test_every_route_and_every_request_field_is_documented(document):
    assert {(method, path) for path, ops in document["paths"].items() for method in ops} == ROUTES
    schemas = document["components"]["schemas"]
    for model in REQUEST_MODELS:
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields), model.__name__
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = document["paths"][path]["post"]
        assert op["requestBody"]["required"] is True
        assert {"200", "400", "401", "413", "500"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    error = schemas["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    # Anthropic's routes answer errors in Anthropic's shape, and say so.
    for path in ANTHROPIC_PATHS:
        responses = document["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "500", "503"} <= set(responses)
        assert all(r["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/AnthropicErrorResponse"}
                   for code, r in responses.items() if code != "200")
    for model in (MessagesRequest, CountTokensRequest, EmbeddingRequest, ScoreRequest, RerankRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields), model.__name__
    assert set(schemas["AnthropicErrorDetail"]["required"]) == {"type", "message"}


@pytest.mark.parametrize("enable_lora", [False, True], ids=["default", "lora"])
def test_the_document_lists_every_route_the_app_serves(enable_lora):
    """Generated, not hand-kept: every API route of the app (the optional ones included) is
    an operation of its document with a request schema where it takes a body. Only the
    document itself, its /docs page, the dashboard's static files and Ollama's API (specified
    by Ollama, read by its client in test_server_ollama.py; docs/ollama.md) are outside it."""
    from fastapi.routing import APIRoute

    from pagedserve.engine_config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.args import ServerConfig
    from pagedserve.entrypoints.openai.server import build_app

    engine = LLMEngine(EngineConfig(kv_cache_memory="16MiB", max_model_len=256, enable_lora=enable_lora))
    app = build_app(engine, ServerConfig(engine=engine.config))
    served = {(m.lower(), r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods
              if not r.path.startswith(OLLAMA_PATH_PREFIX)}
    document = app.openapi()
    documented = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert documented == served == ROUTES | (LORA_ROUTES if enable_lora else set())
    for method, path in served:
        op = document["paths"][path][method]
        if method == "post":
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in document["components"]["schemas"], (path, ref)
    engine.shutdown()


def test_bounds_are_in_the_schema(document):
    fields = document["components"]["schemas"]["CompletionRequest"]["properties"]
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert _variant(fields["n"], "minimum")["minimum"] == 1
    assert _variant(fields["temperature"], "minimum")["minimum"] == 0
    assert _variant(fields["top_p"], "maximum") == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert _variant(fields["logprobs"], "maximum")["maximum"] == MAX_LOGPROBS
    assert _variant(chat["top_logprobs"], "maximum")["maximum"] == MAX_LOGPROBS
    assert _variant(fields["presence_penalty"], "maximum")["maximum"] == MAX_ABS_PENALTY
    assert any(s.get("maxItems") == MAX_STOP_STRINGS for s in fields["stop"]["anyOf"])
    assert _variant(fields["max_tokens"], "minimum")["minimum"] == 0  # 0 with echo scores the prompt
    assert _variant(chat["max_tokens"], "minimum")["minimum"] == 1
    assert "prompt" in document["components"]["schemas"]["CompletionRequest"]["required"]
    assert len(fields["prompt"]["anyOf"]) == 4


@pytest.mark.parametrize("body", [
    {"echo": True, "logprobs": 2, "max_tokens": 0},
    {"echo": True, "logprobs": 1, "max_tokens": 2},
    {"logprobs": 3, "max_tokens": 2},
], ids=["echo-max-tokens-0", "echo-and-generate", "generate"])
def test_logprob_responses_match_the_document(http, document, body):
    # make fuzz found this: with echo the first prompt token's logprob is null, which the
    # documented CompletionLogprobs did not allow.
    model = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post("/v1/completions", json={"model": model, "prompt": "The capital of France is", "temperature": 0,
                                           **body})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert (logprobs["token_logprobs"][0] is None) == body.get("echo", False)
    schema = {"$ref": "#/components/schemas/CompletionResponse", "components": document["components"]}
    jsonschema.validate(r.json(), schema)


def test_docs_page_is_served(http):
    r = http.get("/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


@pytest.fixture(scope="module")
def fuzz_server(server_logs):
    proc = start_server(server_logs, *FUZZ_SERVER_FLAGS)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return load_schema(fuzz_server.url)


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("label", sorted({f"{m.upper()} {p}" for m, p in ROUTES} - UNFUZZED))
def test_schemathesis_finds_nothing(fuzz_server, fuzz_schema, label, mode):
    from schemathesis import GenerationMode

    operation = next(r.ok() for r in fuzz_schema.get_all_operations() if r.ok().label == label)
    run = fuzz_operation(operation, fuzz_server.url, GenerationMode(mode), EXAMPLES, seed=17)
    print(summary(run))
    assert not run.failures, "\n".join(run.failures)
    takes_input = label.startswith("POST")
    if takes_input or mode == "positive":
        assert run.cases > 0
    assert all(status < 500 for status in run.statuses)
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
