"""The one HTTP entry of the Ray Serve app: the routes `pagedserve router` proxies, each
handed to an engine replica through the engine deployment's handle (whose request router,
request_router.py, picks the replica) and relayed back as the replica's server sent it.

A replica that dies with requests on it fails those requests only: one whose reply had not
begun gets a 502 in the API's error shape; a stream that had begun ends with an error
event (router/app.mid_stream_failure). Requests not yet sent wait in the handle's queue
and go to the replicas that are left, and to the one Serve starts in its place; every
replica full past the queue's bound gets a 503."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...http.errors import APIError
from ...model.sources import load_model_tokenizer
from ...router.app import FORWARDED_HEADERS, KEYED_ROUTES, RESPONSE_HEADERS, add_proxied_routes, finish_proxy_app, \
    mid_stream_failure
from ...router.openapi import MODELS_RESPONSES, health_responses
from ...router.prompt_keys import NO_KEYS, PromptKeyer, PromptKeys
from .asgi_call import ProxiedRequest, ReplyStart
from .replica import REPLICA_HEADER
from .settings import RayServeConfig


class Ingress:
    def __init__(self, engine: DeploymentHandle, config: RayServeConfig):
        self.engine = engine.options(stream=True)
        self.config = config
        server = config.server
        self.keyer = PromptKeyer(load_model_tokenizer(server.engine.model), server.tool_call_parser) \
            if config.router.policy == "cache_aware" else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-ingress-tok")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    async def keys(self, path: str, body: bytes) -> PromptKeys:
        if self.keyer is None or path not in KEYED_ROUTES:
            return NO_KEYS
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.keyer.keys, path, body)

    async def forward(self, request: Request, method: str, path: str) -> Response:
        body = await request.body() if method == "POST" else b""
        headers = [(k, v) for k, v in request.headers.items() if k in FORWARDED_HEADERS]
        replies = self.engine.handle.remote(ProxiedRequest(method, path, headers, body, await self.keys(path, body)))
        return await relay(replies, path)


async def relay(replies: DeploymentResponseGenerator, path: str) -> Response:
    """The replica's reply as this ingress's response."""
    try:
        start = await replies.__anext__()
    except RayServeException as e:  # not sent: every replica full past the queue, or none up
        raise APIError(503, f"no engine replica could take the request ({type(e).__name__})", code="no_backend")
    except RayError as e:
        raise APIError(502, f"the engine replica failed before it answered ({type(e).__name__})",
                       code="backend_failed") from e
    assert isinstance(start, ReplyStart)
    headers = {k: v for k, v in start.headers if k.lower() in (*RESPONSE_HEADERS, REPLICA_HEADER)}
    if headers.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(_stream(replies, path), status_code=start.status, headers=headers)
    try:
        content = b"".join([chunk async for chunk in replies])
    except RayError as e:
        raise APIError(502, f"the engine replica failed mid-reply ({type(e).__name__})", code="backend_failed") from e
    return Response(content, status_code=start.status, headers=headers)


async def _stream(replies: DeploymentResponseGenerator, path: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in replies:
            yield chunk
    except RayError:
        yield mid_stream_failure(path)


def build_ingress_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="pagedserve on Ray Serve", redoc_url=None, docs_url=None)

    add_proxied_routes(app, lambda request, path: ingress.forward(request, "POST", path))

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models(request: Request) -> Response:
        return await ingress.forward(request, "GET", "/v1/models")

    @app.get("/health", response_class=Response, responses=health_responses("An engine replica answers."))
    async def health(request: Request) -> Response:
        return await ingress.forward(request, "GET", "/health")

    server = ingress.config.server
    finish_proxy_app(app, server.max_request_body_size, server.api_key)
    return app
