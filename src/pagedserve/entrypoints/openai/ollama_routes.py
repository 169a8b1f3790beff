"""Ollama's API (docs/ollama.md): /api/chat and /api/generate (serving_ollama.py),
/api/embed and /api/embeddings over the embedding path, the listing routes /api/tags,
/api/show, /api/ps and /api/version, and the model-management routes this server
has no store for (/api/pull, /api/push, /api/create, /api/copy, /api/delete: 501).

The routes stay out of /openapi.json, which documents the OpenAI and Anthropic APIs:
Ollama's API is specified by Ollama, and its official client is what the tests speak.
Errors on these routes take Ollama's shape, {"error": "..."} (http/errors.py).
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import __version__
from ...http.errors import APIError
from ...http.json_body import parse_body
from ...http.ollama_bodies import OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaShowRequest, \
    keep_alive_seconds, sampling_options
from ...pooling_params import PoolingParams
from .ollama_models import OllamaModelInfo
from .routes import ServerParts
from .serving import ResponseMeta
from .serving_ollama import OllamaServing
from .serving_pooling import PoolingServing, Vectors

# Model management needs a model store (pull from a registry, build from a Modelfile); this
# server serves the models it was started with.
UNSUPPORTED_ROUTES = {"/api/pull": "POST", "/api/push": "POST", "/api/create": "POST", "/api/copy": "POST",
                      "/api/delete": "DELETE"}
_NS = 1_000_000_000


def ollama_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """Registers Ollama's routes; they add nothing to the OpenAPI document."""
    serving = OllamaServing(parts.context, tool_parser=parts.tool_parser, reasoning_parser=parts.reasoning_parser)
    embedding = OllamaEmbedding(parts.context)
    _post(app, "/api/chat", serving.chat)
    _post(app, "/api/generate", serving.generate)
    _post(app, "/api/embed", embedding.embed)
    _post(app, "/api/embeddings", embedding.embeddings)
    _listing_routes(app, parts)
    for path, method in UNSUPPORTED_ROUTES.items():
        app.add_api_route(path, _unsupported(path), methods=[method], include_in_schema=False)
    return []


def _post(app: FastAPI, path: str, handle: Callable[[Request], Awaitable[Response]]) -> None:
    async def endpoint(request: Request) -> Response:
        return await handle(request)

    app.add_api_route(path, endpoint, methods=["POST"], include_in_schema=False)


def _unsupported(path: str) -> Callable[[], Awaitable[Response]]:
    async def endpoint() -> Response:
        raise APIError(501, f"{path} is not supported: this server serves the models it was started with "
                            "(--model) and has no model store to pull, push, create, copy or delete")

    return endpoint


def _listing_routes(app: FastAPI, parts: ServerParts) -> None:
    engine = parts.context.engine
    infos = {name: OllamaModelInfo.of(name, engine.engine, engine.max_context_len, parts.tool_parser is not None,
                                      parts.reasoning_parser is not None)
             for name in parts.context.models.base_names}

    async def tags() -> JSONResponse:
        return JSONResponse({"models": [info.tag() for info in infos.values()]})

    async def show(request: Request) -> JSONResponse:
        req = parse_body(await request.body(), OllamaShowRequest)
        name = parts.context.models.resolve(req.model)
        # A LoRA adapter is shown as the model it runs on.
        return JSONResponse(infos.get(name, infos[parts.context.models.base_names[0]]).show())

    async def ps() -> JSONResponse:
        # One engine holds the model for the server's life: it never expires.
        return JSONResponse({"models": [info.running(None, 0) for info in infos.values()]})

    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    app.add_api_route("/api/tags", tags, methods=["GET"], include_in_schema=False)
    app.add_api_route("/api/show", show, methods=["POST"], include_in_schema=False)
    app.add_api_route("/api/ps", ps, methods=["GET"], include_in_schema=False)
    app.add_api_route("/api/version", version, methods=["GET"], include_in_schema=False)


class OllamaEmbedding(PoolingServing):
    """/api/embed (normalised vectors, several inputs) and /api/embeddings (one prompt, the raw vector)."""

    async def embed(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(await request.body(), OllamaEmbedRequest)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        if not inputs:
            raise APIError(400, "input must hold at least one text", param="input")

        def respond(vectors: Vectors, num_tokens: int) -> Response:
            return JSONResponse({"model": meta.model, "embeddings": [list(v) for v in vectors],
                                 "total_duration": int((time.monotonic() - arrival) * _NS), "load_duration": 0,
                                 "prompt_eval_count": num_tokens})

        meta = self._checked(req.model, req.options, req.keep_alive)
        return await self._pool(request, arrival, meta, inputs, self._pooling(True, req.dimensions), 0, "input",
                                respond)

    async def embeddings(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(await request.body(), OllamaEmbeddingsRequest)
        meta = self._checked(req.model, req.options, req.keep_alive)

        def respond(vectors: Vectors, num_tokens: int) -> Response:
            return JSONResponse({"embedding": list(vectors[0])})

        return await self._pool(request, arrival, meta, [req.prompt], self._pooling(False, None), 0, "prompt",
                                respond)

    def _checked(self, model: str, options: dict | None, keep_alive: float | str | None) -> ResponseMeta:
        """The response's meta for the served `model` (404 for another); options and keep_alive checked."""
        name = self.resolve_model(model)
        sampling_options(options, self.engine.max_context_len)  # sampling options do not touch an embedding
        keep_alive_seconds(keep_alive)
        return ResponseMeta(f"embd-{time.monotonic_ns()}", int(time.time()), name)

    def _pooling(self, normalize: bool, dimensions: int | None) -> PoolingParams:
        pooling = PoolingParams(normalize=normalize, dimensions=dimensions)
        try:
            pooling.validate_for_model(self.engine.engine.loaded.config.hidden_size)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from None
        return pooling

