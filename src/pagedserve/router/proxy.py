"""The router's ASGI app: the OpenAI endpoints proxied to one replica each, streamed
chunk by chunk, plus /health, /v1/models and /metrics.

A request goes to the replica its policy picks among those up. A connection error
before the reply has started (refused, reset, the replica died mid-request) marks that
replica down and sends the request to another; once streamed bytes reached the client
there is no retry: the stream ends with an error event. A client that goes away closes
the connection to the replica, which aborts the request there and frees its blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from ..http.disconnect import named_sse, sse, until_disconnected
from ..http.errors import ANTHROPIC_PATHS, APIError, install_error_handlers
from ..http.json_body import validation_error
from ..http.middleware import APIKeyMiddleware, BodyLimitMiddleware
from .backends import Backend, BackendMonitor
from .choice import choose_backend
from .router_metrics import RouterMetrics
from .router_openapi import (METRICS_RESPONSES, MODELS_RESPONSES, POOLING_PATHS, health_responses, proxied_post,
                             serve_document)
from .routing_policies import CacheAwareConfig, Picker
from .prompt_keys import NO_KEYS, PromptKeyer, PromptKeys

logger = logging.getLogger("pagedserve.router")

# Routes whose prompt the router hashes for cache_aware; the others go by load.
KEYED_ROUTES = ("/v1/completions", "/v1/chat/completions")
PROXIED_ROUTES = (*KEYED_ROUTES, "/v1/responses", *sorted(ANTHROPIC_PATHS), "/tokenize", "/detokenize",
                  *POOLING_PATHS)
# Request headers passed on to a replica (hop-by-hop ones and the router's own key are not).
FORWARDED_HEADERS = ("content-type", "accept", "x-request-id")
RESPONSE_HEADERS = ("content-type", "x-request-id", "retry-after")


@dataclass
class RouterConfig:
    backends: list[str]
    policy: str = "cache_aware"
    api_key: str | None = None  # what clients of the router must send
    backend_api_key: str | None = None  # what the router sends to the replicas
    cache: CacheAwareConfig = CacheAwareConfig()
    health_interval_s: float = 1.0
    routed_ttl_s: float = 30.0
    max_request_body_size: int = 4 << 20
    tokenizer_threads: int = 1

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("backends must name at least one replica URL")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend must be an http:// or https:// URL, got {url!r}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends must be distinct, got {self.backends}")
        if not self.health_interval_s > 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if self.api_key == "" or self.backend_api_key == "":
            raise ValueError("api keys must not be empty")


class Router:
    def __init__(self, config: RouterConfig, keyer: PromptKeyer | None):
        self.config = config
        self.backends = [Backend(url.rstrip("/")) for url in config.backends]
        self.picker = Picker(config.policy, config.cache)
        if self.picker.needs_keys and keyer is None:
            raise ValueError("the cache_aware policy needs the model's tokenizer")
        self.keyer = keyer
        self.metrics = RouterMetrics(self.backends, self.picker)
        self._headers = {"Authorization": f"Bearer {config.backend_api_key}"} if config.backend_api_key else {}
        self._executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="pagedserve-router-tok")
        self.session: aiohttp.ClientSession | None = None
        self.monitor: BackendMonitor | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self.monitor = BackendMonitor(self.backends, self.session, self._headers, self.config.health_interval_s,
                                      watch_events=self.picker.needs_keys)
        await self.monitor.start()

    async def close(self) -> None:
        if self.monitor is not None:
            await self.monitor.stop()
        if self.session is not None:
            await self.session.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def keys(self, path: str, body: bytes) -> PromptKeys:
        if not self.picker.needs_keys or path not in KEYED_ROUTES:
            return NO_KEYS
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.keyer.keys, path, body)

    def choose(self, keys: PromptKeys, exclude: set[Backend]) -> Backend | None:
        up = [b for b in self.backends if b.healthy and b not in exclude]
        return choose_backend(self.picker, up, keys, self.config.routed_ttl_s) if up else None

    def forward_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        return {**headers, **self._headers}

    async def proxy(self, request: Request, path: str) -> Response:
        body = await request.body()
        keys = await self.keys(path, body)
        headers = self.forward_headers(request)
        tried: set[Backend] = set()
        while True:
            backend = self.choose(keys, tried)
            if backend is None:
                raise APIError(503, "no backend replica is available", code="no_backend")
            tried.add(backend)
            backend.in_flight += 1
            backend.num_requests += 1
            handed_over = False
            try:
                reply = await self.session.post(backend.url + path, data=body, headers=headers)
                if reply.status == 503:  # draining or its engine stopped: another replica may serve it
                    reply.release()
                    backend.mark_down("it answered 503")
                    continue
                if reply.content_type == "text/event-stream":
                    handed_over = True
                    return StreamingResponse(self._stream(backend, reply, path), status_code=reply.status,
                                             headers=_reply_headers(reply))
                result = await until_disconnected(request, self._read(reply))
                return result
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                backend.num_errors += 1
                backend.mark_down(f"{type(e).__name__}: {e}")
                self.metrics.retries.inc()
            finally:
                if not handed_over:
                    backend.in_flight -= 1

    async def _read(self, reply: aiohttp.ClientResponse) -> Response:
        try:
            content = await reply.read()
        except asyncio.CancelledError:
            reply.close()  # the client left: dropping the connection aborts the request there
            raise
        return Response(content, status_code=reply.status, headers=_reply_headers(reply))

    async def _stream(self, backend: Backend, reply: aiohttp.ClientResponse, path: str) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in reply.content.iter_any():
                yield chunk
            finished = True
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            backend.num_errors += 1
            backend.mark_down(f"{type(e).__name__}: {e}")
            yield mid_stream_failure(path)
        finally:
            backend.in_flight -= 1
            if finished:
                reply.release()
            else:
                reply.close()

    async def models(self) -> Response:
        for backend in self.backends:
            if backend.healthy:
                try:
                    async with self.session.get(backend.url + "/v1/models", headers=self._headers,
                                                timeout=aiohttp.ClientTimeout(total=10)) as reply:
                        return Response(await reply.read(), status_code=reply.status, headers=_reply_headers(reply))
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    backend.mark_down(f"{type(e).__name__}: {e}")
        raise APIError(503, "no backend replica is available", code="no_backend")


def mid_stream_failure(path: str) -> bytes:
    """The event that ends a stream whose replica failed after it began (there is no status
    to change by then), in the stream's own framing: Anthropic's named error event on its routes."""
    error = APIError(502, "the backend replica failed mid-stream", code="backend_failed")
    return (named_sse(error.anthropic_body()) if path in ANTHROPIC_PATHS else sse(error.body())).encode()


def _reply_headers(reply: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in reply.headers.items() if k.lower() in RESPONSE_HEADERS}


def build_router_app(config: RouterConfig, keyer: PromptKeyer | None) -> FastAPI:
    router = Router(config, keyer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="pagedserve router", lifespan=lifespan, redoc_url=None, docs_url=None)
    app.state.router = router

    add_proxied_routes(app, router.proxy)

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> Response:
        return await router.models()

    @app.get("/health", response_class=Response, responses=health_responses("At least one replica is up."))
    async def health() -> Response:
        return Response(status_code=200 if any(b.healthy for b in router.backends) else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return router.metrics.response()

    finish_proxy_app(app, config.max_request_body_size, config.api_key)
    return app


def add_proxied_routes(app: FastAPI, proxy: Callable[[Request, str], Awaitable[Response]]) -> None:
    """PROXIED_ROUTES, each documented as the server's own and handed to `proxy(request, path)`
    (this router's, or the Ray Serve ingress's)."""
    def route(path: str) -> None:
        async def endpoint(request: Request) -> Response:
            return await proxy(request, path)

        app.add_api_route(path, endpoint, name="proxy", **proxied_post(path))

    for path in PROXIED_ROUTES:
        route(path)


def finish_proxy_app(app: FastAPI, max_request_body_size: int, api_key: str | None) -> None:
    """After the routes: the document, the errors in the API's shape, the body limit and the key check."""
    serve_document(app)
    install_error_handlers(app, {RequestValidationError: validation_error})
    app.add_middleware(BodyLimitMiddleware, limit=max_request_body_size)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

