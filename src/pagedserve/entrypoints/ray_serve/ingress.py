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
import json
import logging
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
from ...router.proxy import FORWARDED_HEADERS, KEYED_ROUTES, RESPONSE_HEADERS, add_proxied_routes, finish_proxy_app, \
    mid_stream_failure
from ...router.disagg import GENERATION_PATHS, client_body, prefill_body, prefill_outcome
from ...router.router_openapi import MODELS_RESPONSES, health_responses
from ...router.prompt_keys import NO_KEYS, PromptKeyer, PromptKeys
from .asgi_call import ProxiedRequest, ReplyStart
from .replica import REPLICA_HEADER
from .settings import RayServeConfig

logger = logging.getLogger("pagedserve.ray_serve")


class Ingress:
    def __init__(self, engine: DeploymentHandle, config: RayServeConfig, prefill: DeploymentHandle | None = None):
        """`engine`: the replicas that answer (the decode deployment under P/D); `prefill`:
        P/D's prefill deployment, which computes each generation's prompt KV first."""
        self.engine = engine.options(stream=True)
        self.prefill = prefill.options(stream=True) if prefill is not None else None
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
        if self.prefill is not None and path in GENERATION_PATHS:
            return await self.disaggregated(path, headers, body)
        replies = self.engine.handle.remote(ProxiedRequest(method, path, headers, body, await self.keys(path, body)))
        return await relay(replies, path)

    async def disaggregated(self, path: str, headers: list[tuple[str, str]], raw: bytes) -> Response:
        """`pagedserve router --prefill --decode`'s two phases (router/disagg.py) over the two
        deployments: the prefill deployment's kv_transfer_params go to the decode deployment,
        which pulls the prompt's blocks instead of computing them. A prefill that fails costs
        only speed (the decode replica prefills); its client error is the client's answer."""
        body = client_body(raw)
        if isinstance(body, Response):
            return body
        asked = ProxiedRequest("POST", path, headers, json.dumps(prefill_body(body)).encode(),
                               await self.keys(path, raw))
        replies = self.prefill.handle.remote(asked)
        try:
            start = await replies.__anext__()
            content = b"".join([chunk async for chunk in replies])
        except (RayError, RayServeException) as e:
            logger.warning("the prefill deployment failed (%s); the decode replica prefills", type(e).__name__)
            params: dict | Response = {}
        else:
            params = prefill_outcome("the prefill deployment", start.status, content,
                                     dict(start.headers).get("content-type"))
        if isinstance(params, Response):
            return params
        decode_body = {**body, "kv_transfer_params": params} if params else body
        return await relay(self.engine.handle.remote(ProxiedRequest("POST", path, headers,
                                                                    json.dumps(decode_body).encode())), path)


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
