"""`pagedserve router --prefill URL... --decode URL...`: the proxy of disaggregated
prefill/decode. The client sees one ordinary OpenAI endpoint.

Per request (POST /v1/completions or /v1/chat/completions):
1. send it to a prefill instance with max_tokens=1, n=1, stream off and
   kv_transfer_params {"do_remote_decode": true}; the response's kv_transfer_params
   say where that instance holds the prompt's KV blocks;
2. send the original request, with those kv_transfer_params, to a decode instance,
   which pulls the blocks instead of prefilling, and relay its reply (streamed or not).

Instances are taken round-robin. A prefill instance that cannot be reached or fails
(5xx) costs only speed: the request goes to a decode instance without parameters and
is prefilled there; a client error (4xx) from it is the client's answer. A decode
instance that cannot be reached is skipped for the next. A client that leaves while
its request is at the prefill instance aborts it there; one that leaves between the
two phases has the router release the held blocks (a RELEASE frame to the producer's
block server); one that leaves during the decode aborts it on the decode instance,
which releases its side.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..http.disconnect import CLIENT_CLOSED, sse, unless_disconnected
from ..http.errors import APIError, install_error_handlers
from ..http.middleware import BodyLimitMiddleware
from ..kv_transfer.frame import Frame, Kind, send_frame
from .router_openapi import MODELS_RESPONSES, health_responses, proxied_post, serve_document

logger = logging.getLogger(__name__)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Headers that describe one hop's connection or body, not the request.
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return APIError(status, message, code=code).response()


@dataclass
class DisaggConfig:
    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    # Seconds a whole upstream request may take (a long prompt on a CPU is slow).
    timeout: float = 600.0
    # As the replica router's: the body is read whole (and parsed) before any instance sees it.
    max_request_body_size: int = 4 << 20

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the P/D router needs at least one --prefill and one --decode URL")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL {url!r} must start with http:// or https://")


class DisaggRouter:
    def __init__(self, config: DisaggConfig):
        self.config = config
        self._prefill = itertools.cycle([u.rstrip("/") for u in config.prefill_urls])
        self._decode_urls = [u.rstrip("/") for u in config.decode_urls]
        self._decode = itertools.cycle(range(len(self._decode_urls)))
        self.client: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # aiohttp, as the replica router (router/proxy.py): one client library for the router.
        self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=self.config.timeout, sock_connect=5.0),
                                            auto_decompress=False)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    # -- the two phases ------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        body = client_body(await request.body())
        if isinstance(body, Response):
            return body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        path = request.url.path
        prefill = await unless_disconnected(request, self._prefill_phase(path, body, headers))
        if prefill is None:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(prefill, Response):
            return prefill
        params = prefill or None
        decode_body = {**body, "kv_transfer_params": params} if params else body
        response = await unless_disconnected(request, self._open_decode(path, decode_body, headers))
        if response is None:
            if params:
                await asyncio.to_thread(_release_remote, params)
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(response, Response):
            return response
        return self._relay(response)

    async def _prefill_phase(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict | Response:
        """The prefill's kv_transfer_params ({} when the decode instance must prefill), or
        the prefill instance's client error for the client."""
        url = next(self._prefill) + path
        try:
            async with self.client.post(url, json=prefill_body(body), headers=headers) as reply:
                content = await reply.read()
                status, content_type = reply.status, reply.headers.get("content-type")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("prefill instance %s failed (%s); the decode instance prefills", url, e)
            return {}
        return prefill_outcome(url, status, content, content_type)

    async def _open_decode(self, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> aiohttp.ClientResponse | Response:
        """The decode instance's response, headers read and body not yet; the next instance
        when one cannot be reached."""
        for _ in range(len(self._decode_urls)):
            url = self._decode_urls[next(self._decode)] + path
            try:
                return await self.client.post(url, json=body, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                logger.warning("decode instance %s failed: %s", url, e)
        params = body.get("kv_transfer_params")
        if params:
            await asyncio.to_thread(_release_remote, params)
        return _error(503, "no decode instance could be reached", "decode_unavailable")

    def _relay(self, upstream: aiohttp.ClientResponse) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                logger.warning("decode instance failed mid-response: %s", e)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    failed = APIError(500, "the decode instance failed mid-response", code="decode_failed")
                    yield sse(failed.body()).encode()
            finally:
                # Closing before the end (the client left) makes the decode instance abort.
                upstream.close()

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS | {"content-encoding"}}
        return StreamingResponse(body(), upstream.status, headers=headers)

    # -- pass-through ---------------------------------------------------------------------

    async def passthrough(self, request: Request) -> Response:
        """GET routes (models, health) from the first decode instance that answers."""
        for url in self._decode_urls:
            try:
                async with self.client.get(url + request.url.path, headers={
                        k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}) as reply:
                    return Response(await reply.read(), reply.status, media_type=reply.headers.get("content-type"))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return _error(503, "no decode instance could be reached", "decode_unavailable")


def client_body(raw: bytes) -> dict[str, Any] | Response:
    """The client's request as a JSON object, or the 400 it gets (the router, not the client,
    sets kv_transfer_params)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"the body is not valid JSON: {e}", "invalid_json")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object", "invalid_body")
    if "kv_transfer_params" in body:
        return _error(400, "kv_transfer_params is set by the router, not the client", "invalid_parameter")
    return body


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill instance is asked: the prompt, one token, its KV held for a decode instance."""
    out = {**body, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    for key in ("stream_options", "max_completion_tokens", "min_tokens"):
        out.pop(key, None)
    return out


def prefill_outcome(where: str, status: int, content: bytes, content_type: str | None) -> dict | Response:
    """The prefill's kv_transfer_params ({}: the decode instance prefills), or, for a client
    error, the prefill instance's answer for the client."""
    if 400 <= status < 500:
        return Response(content, status, media_type=content_type)
    if status != 200:
        logger.warning("prefill instance %s answered %d; the decode instance prefills", where, status)
        return {}
    try:
        return json.loads(content).get("kv_transfer_params") or {}
    except (ValueError, AttributeError):
        logger.warning("prefill instance %s answered no JSON object; the decode instance prefills", where)
        return {}


def _release_remote(params: dict[str, Any]) -> None:
    """Tell a producer that nobody will pull its blocks (else its lease frees them later)."""
    try:
        with socket.create_connection((params["remote_host"], params["remote_port"]), 5.0) as s:
            send_frame(s, Frame(Kind.RELEASE, params["remote_request_id"]))
    except (OSError, KeyError, TypeError) as e:
        logger.info("could not release a prefill's blocks: %s", e)


def build_disagg_app(config: DisaggConfig) -> FastAPI:
    router = DisaggRouter(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    # FastAPI (as the replica router) for the OpenAPI document; the routes parse nothing themselves.
    app = FastAPI(title="pagedserve P/D router", lifespan=lifespan, redoc_url=None, docs_url=None)
    for path in GENERATION_PATHS:
        app.add_api_route(path, router.generate, name="prefill_then_decode", **proxied_post(path))
    app.add_api_route("/v1/models", router.passthrough, methods=["GET"], name="models", responses=MODELS_RESPONSES)
    app.add_api_route("/health", router.passthrough, methods=["GET"], name="health", response_class=Response,
                      responses=health_responses("A decode instance answered 200."))
    serve_document(app)
    install_error_handlers(app, {})
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_size)
    app.state.router = router
    return app


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregated prefill/decode")
    g.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill instances (serve --kv-transfer-config with kv_role kv_producer)")
    g.add_argument("--decode", nargs="+", default=[], metavar="URL",
                   help="decode instances (kv_role kv_consumer)")
    g.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds one upstream request may take")


def disagg_app_from_args(args: argparse.Namespace) -> FastAPI:
    return build_disagg_app(DisaggConfig(args.prefill, args.decode, args.upstream_timeout))
