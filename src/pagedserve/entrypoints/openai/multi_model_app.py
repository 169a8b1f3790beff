"""The front of a multi-model server (docs/multi-model.md): it reads each request's
`model` (the JSON body's field, or `?model=` on a body-less request), has the model host
load that model if it must (model_host.py), and hands the request, body and all, to
that model's own app. The listing routes (/v1/models, /api/tags, /api/ps), /health,
/version and vLLM's sleep routes (/sleep, /wake_up, /is_sleeping) are the front's own.

Ollama's keep_alive on an /api/ request sets how long its model stays loaded once idle
(0: unloaded as the request ends).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ... import __version__
from ...http.bounds import limited_http_protocol
from ...http.errors import OLLAMA_PATH_PREFIX, APIError, install_error_handlers
from ...http.middleware import APIKeyMiddleware, BodyLimitMiddleware
from ...http.ollama_bodies import keep_alive_seconds
from .args import ServerConfig
from .model_host import BuildApp, HostedModel, ModelHost, run_reaper
from .models_config import model_specs
from .ollama_models import file_facts, iso_time

logger = logging.getLogger("pagedserve.server")

FRONT_PATHS = frozenset({"/v1/models", "/api/tags", "/api/ps", "/health", "/version", "/api/version", "/sleep",
                         "/wake_up", "/is_sleeping"})
# How often idle models are checked against their keep_alive.
_REAPER_PERIOD_S = 1.0
_SLEEP_LEVELS = (1, 2)


class MultiModelApp:
    """The ASGI app of a multi-model server."""

    def __init__(self, host: ModelHost):
        self.host = host
        self.front = front_app(host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in FRONT_PATHS:
            await self.front(scope, receive, send)
            return
        path = scope["path"]
        try:
            body = await _read_body(receive)
            fields = _json_fields(body)
            model = self.host.resolve(fields.get("model") or Request(scope).query_params.get("model"))
            keep_alive = keep_alive_seconds(fields.get("keep_alive")) if path.startswith(OLLAMA_PATH_PREFIX) else None
            app = await self.host.acquire(model)
        except APIError as e:
            await e.response(path)(scope, receive, send)
            return
        try:
            await app(scope, _replay(body, receive), send)
        finally:
            self.host.release(model, keep_alive)
            if keep_alive == 0:
                await self.host.unload_expired()


def front_app(host: ModelHost) -> FastAPI:
    app = FastAPI(title="pagedserve", version=__version__, lifespan=_lifespan(host), redoc_url=None,
                  docs_url=None, openapi_url=None)
    install_error_handlers(app, {})
    created = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_card(m, created) for m in host.models.values()]})

    @app.get("/api/tags")
    async def tags() -> JSONResponse:
        return JSONResponse({"models": [_tag(m) for m in host.models.values()]})

    @app.get("/api/ps")
    async def ps() -> JSONResponse:
        return JSONResponse({"models": [_running(m) for m in host.models.values() if m.state == "loaded"]})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    @app.get("/api/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    _sleep_routes(app, host)
    return app


def _sleep_routes(app: FastAPI, host: ModelHost) -> None:
    """vLLM's: POST /sleep?level=1|2 (and model=), POST /wake_up, GET /is_sleeping."""

    @app.post("/sleep")
    async def sleep(level: int = 1, model: str | None = None) -> Response:
        if level not in _SLEEP_LEVELS:
            raise APIError(400, f"level must be 1 (free the KV cache) or 2 (free the weights too), got {level}",
                           param="level")
        await host.sleep(host.resolve(model), level)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(model: str | None = None) -> Response:
        await host.wake_up(host.resolve(model))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(model: str | None = None) -> JSONResponse:
        return JSONResponse({"is_sleeping": host.resolve(model).state == "sleeping"})


def _lifespan(host: ModelHost):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        reaper = asyncio.ensure_future(run_reaper(host, _REAPER_PERIOD_S, stop))
        try:
            yield
        finally:
            stop.set()
            await reaper
            await host.close()

    return lifespan


def _card(model: HostedModel, created: int) -> dict[str, Any]:
    engine = model.engine
    card = {"id": model.name, "object": "model", "created": created, "owned_by": "pagedserve", "root": model.path,
            "parent": None, **model.card()}
    if engine is not None:
        card["max_model_len"] = model.app.state.engine.max_context_len
    return card


def _tag(model: HostedModel) -> dict[str, Any]:
    size, modified, digest = file_facts(model.path)
    return {"name": model.name, "model": model.name, "modified_at": iso_time(modified), "size": size,
            "digest": digest, "details": {"format": "gguf" if model.path.endswith(".gguf") else "safetensors"},
            **model.card()}


def _running(model: HostedModel) -> dict[str, Any]:
    remaining = None if model.expires_at is None else model.expires_at - time.monotonic()
    expires = None if remaining is None else iso_time(time.time() + remaining)
    return {**_tag(model), "expires_at": expires, "size_vram": 0,
            "context_length": model.app.state.engine.max_context_len}


async def _read_body(receive: Receive) -> bytes:
    """The request's whole body (BodyLimitMiddleware, outside, bounds it)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _json_fields(body: bytes) -> dict[str, Any]:
    """The body's top-level fields when it is a JSON object (else none: the model's app answers the error)."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {type(model).__name__}", param="model")
    return data


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then what the client sends next (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def run_multi_model_server(config: ServerConfig, build_app: BuildApp) -> int:
    """Serve config.models / config.models_dir until SIGTERM: in-flight requests get
    --shutdown-timeout seconds, then every loaded model is stopped."""
    models = model_specs(config.models, config.models_dir, config.models_config, config.engine)
    host = ModelHost(config, models, build_app)
    app: ASGIApp = MultiModelApp(host)
    app = BodyLimitMiddleware(app, limit=config.max_request_body_size)
    if config.api_key:
        app = APIKeyMiddleware(app, api_key=config.api_key)
    logger.info("serving %d models on http://%s:%d: %s", len(models), config.host, config.port, ", ".join(models))
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, lifespan="on",
        http=limited_http_protocol(config.max_header_size, config.header_timeout),
        log_level=config.uvicorn_log_level, access_log=not config.disable_uvicorn_access_log,
        timeout_graceful_shutdown=int(config.shutdown_timeout)))
    server.run()
    return 0


class _Server(uvicorn.Server):
    """uvicorn that stops on SIGTERM / SIGINT and exits 0 (no re-raised signal): in-flight
    requests get the graceful-shutdown time, then the lifespan stops every model."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.should_exit = True
