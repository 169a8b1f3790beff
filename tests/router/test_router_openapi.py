"""Both routers publish an OpenAPI document that is their app: every route they serve,
nothing else, each documented with the request model and responses the server's own
document gives that route (what comes back through a router is a replica's answer), so
schemathesis can hold a router to the server's contract (test_router_fuzz.py)."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai.args import ServerConfig
from pagedserve.entrypoints.openai.server import build_app
from pagedserve.router.proxy import PROXIED_ROUTES, RouterConfig, build_router_app
from pagedserve.router.disagg import DisaggConfig, build_disagg_app

REPLICA_ROUTES = {("post", p) for p in PROXIED_ROUTES} | {("get", "/v1/models"), ("get", "/health"),
                                                            ("get", "/metrics")}
DISAGG_ROUTES = {("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models"),
                 ("get", "/health")}
ROUTERS = {
    "replica": (lambda: build_router_app(RouterConfig(["http://127.0.0.1:1"], policy="round_robin"), None),
                REPLICA_ROUTES),
    "disagg": (lambda: build_disagg_app(DisaggConfig(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])),
               DISAGG_ROUTES),
}


@pytest.fixture(scope="module")
def server_document() -> dict:
    engine = LLMEngine(EngineConfig(kv_cache_memory="16MiB", max_model_len=256))
    try:
        return build_app(engine, ServerConfig(engine=engine.config)).openapi()
    finally:
        engine.shutdown()


def served(app: FastAPI) -> set[tuple[str, str]]:
    return {(m.lower(), r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def resolved(node, schemas: dict):
    """`node` with every $ref replaced by the schema it names: the documents may name a model
    differently (the server's has two `Usage`s, its own and Anthropic's), not describe it so."""
    if isinstance(node, dict):
        if "$ref" in node:
            return resolved(schemas[node["$ref"].rsplit("/", 1)[1]], schemas)
        return {k: resolved(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [resolved(v, schemas) for v in node]
    return node


@pytest.mark.parametrize("mode", list(ROUTERS))
def test_the_document_is_the_routes_with_the_servers_contract(mode, server_document):
    build, routes = ROUTERS[mode]
    app = build()
    document = app.openapi()
    documented = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert documented == served(app) == routes
    schemas, server_schemas = document["components"]["schemas"], server_document["components"]["schemas"]
    for method, path in routes:
        mine = resolved(document["paths"][path][method], schemas)
        servers = resolved(server_document["paths"][path][method], server_schemas)
        assert mine.get("requestBody") == servers.get("requestBody"), (method, path)
        # Every status the server documents, with the same content; the router may add its own.
        assert set(servers["responses"]) <= set(mine["responses"]), (method, path)
        for status, response in servers["responses"].items():
            assert mine["responses"][status].get("content") == response.get("content"), (method, path, status)
