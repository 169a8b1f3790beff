"""The OpenAI-compatible HTTP server: app factory, uvicorn runner, graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops admitting (new requests get 503), lets
in-flight requests finish for up to `--shutdown-timeout` seconds, aborts the rest
(their responses end with finish_reason "abort"), then exits 0. A second signal
skips the wait.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from types import FrameType

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware

from ... import __version__
from ...engine.async_engine import AsyncEngine, EngineDeadError
from ...engine.llm_engine import LLMEngine
from ...http.bounds import limited_http_protocol
from ...http.errors import install_error_handlers
from ...http.json_body import validation_error
from ...http.middleware import APIKeyMiddleware, BodyLimitMiddleware
from ...http.tenants import TenantMiddleware, Tenants
from ...http.openapi import build_openapi
from ...http.tool_parsers import TOOL_PARSERS
from .args import ServerConfig, server_reasoning_parser
from .batch_routes import batch_routes
from .metrics import ServerMetrics
from .multi_model_app import run_multi_model_server
from .ollama_routes import ollama_routes
from .protocol import RequestLimits, max_prompt_chars
from .routes import RouteGroup, ServerParts, dashboard_routes, kv_event_routes, lora_routes, openai_routes, \
    operations_routes, tokenizer_routes
from .served_models import ServedModels
from .serving import Admission, ServingContext, engine_error
from .serving_messages import messages_routes
from .serving_pooling import pooling_routes
from .tenant_metrics import TenantCollector

logger = logging.getLogger("pagedserve.server")

# Tokenising and template rendering run here; two threads keep up with one engine
# on a small machine without starving the engine thread of cores.
_TOKENIZER_THREADS = 2
# After the shutdown timeout, how long aborted responses get to reach their clients.
_ABORTED_RESPONSES_GRACE_S = 5.0


# In the order their routes appear in /openapi.json; a new group is one more entry.
ROUTE_GROUPS: tuple[RouteGroup, ...] = (
    openai_routes, messages_routes, pooling_routes, tokenizer_routes, operations_routes, kv_event_routes, lora_routes,
    dashboard_routes, batch_routes, ollama_routes,
)


def build_app(engine: LLMEngine, config: ServerConfig, tenants: Tenants | None = None) -> FastAPI:
    """The ASGI app around `engine`. The engine thread starts and stops with the app's lifespan.
    With --api-keys, `tenants` is its file loaded (loaded here when not given)."""
    parts = _server_parts(engine, config)
    if config.api_keys is not None and tenants is None:
        tenants = Tenants(config.api_keys)
    if tenants is not None:
        parts.metrics.registry.register(TenantCollector(tenants, parts.model_names[0]))
    app = FastAPI(title="pagedserve", version=__version__, lifespan=_lifespan(parts, tenants),
                  redoc_url=None,
                  description="An OpenAI-compatible LLM server.", separate_input_output_schemas=False)
    app.state.engine = parts.context.engine
    app.state.admission = parts.context.admission
    app.state.tenants = tenants
    request_models = [model for group in ROUTE_GROUPS for model in group(app, parts)]
    document = build_openapi(app, tuple(request_models))
    app.openapi = lambda: document  # type: ignore[method-assign]  # built once; the routes are fixed
    install_error_handlers(app, {RequestValidationError: validation_error, EngineDeadError: engine_error})
    _add_middleware(app, config, tenants)
    return app


def _server_parts(engine: LLMEngine, config: ServerConfig) -> ServerParts:
    """The async engine around `engine`, its admission, metrics and limits, and the tokenizer threads."""
    model_names = config.served_model_name or [engine.loaded.name]
    metrics = ServerMetrics(model_names[0])
    async_engine = AsyncEngine(engine)
    async_engine.add_step_listener(metrics.on_step)
    metrics.watch(async_engine)
    vocabulary = engine.tokenizer.backend.get_vocab(with_added_tokens=True)
    limits = RequestLimits(config.max_n, config.max_logprobs, async_engine.vocab_size,
                           max_prompt_chars(vocabulary, async_engine.max_context_len))
    context = ServingContext(
        async_engine, Admission(async_engine, config.max_queued_requests), limits,
        ServedModels(model_names, engine.list_loras()),
        ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="pagedserve-tokenize"), config.image_policy())
    tool_parser = TOOL_PARSERS[config.tool_call_parser] if config.tool_call_parser else None
    return ServerParts(context, config, metrics, model_names, tool_parser,
                       server_reasoning_parser(config.reasoning_parser, engine.tokenizer.chat_template))


def _lifespan(parts: ServerParts,
              tenants: Tenants | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    context = parts.context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        context.engine.start()
        stop_watching = tenants.watch_sighup(asyncio.get_running_loop()) if tenants is not None else None
        background = [asyncio.ensure_future(run()) for run in parts.background]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if stop_watching is not None:
                stop_watching()
            await context.engine.close()
            context.executor.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _add_middleware(app: FastAPI, config: ServerConfig, tenants: Tenants | None) -> None:
    # Added innermost first: requests pass CORS, then the key check (or the tenants'), then the body limit.
    # File uploads stream to disk under their own cap (batch_routes.py), unbuffered.
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_size, streamed=frozenset({"/v1/files"}))
    if tenants is not None:
        app.add_middleware(TenantMiddleware, tenants=tenants)
    elif config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)


async def drain(app: FastAPI, timeout: float, *, skip_wait: asyncio.Event) -> None:
    """Stop admitting, give in-flight requests `timeout` seconds, then abort the rest."""
    admission: Admission = app.state.admission
    engine: AsyncEngine = app.state.engine
    admission.draining = True
    logger.info("shutting down: %d requests in flight, waiting up to %.0f s", admission.num_active, timeout)
    idle = asyncio.ensure_future(admission.wait_idle())
    skip = asyncio.ensure_future(skip_wait.wait())
    await asyncio.wait((idle, skip), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    skip.cancel()
    if not idle.done():
        logger.info("aborting %d requests still in flight", engine.num_unfinished)
        engine.abort_all()
        # Aborted responses end at once unless a client stopped reading; do not wait on those.
        await asyncio.wait((idle,), timeout=_ABORTED_RESPONSES_GRACE_S)


class GracefulServer(uvicorn.Server):
    """uvicorn that drains on SIGTERM/SIGINT and exits 0 (no re-raised signal)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float):
        super().__init__(config)
        self._app = app
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._skip_wait: asyncio.Event | None = None
        self._draining = False
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._skip_wait = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        if self._draining:
            self._loop.call_soon_threadsafe(self._skip_wait.set)
            return
        self._draining = True
        logger.info("received %s", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    def exit_after_crash(self, error: BaseException) -> None:
        """The engine thread crashed (its requests already failed): stop serving and exit
        non-zero, so a supervisor restarts the server instead of it answering 503 forever."""
        logger.error("the engine crashed (%s: %s); shutting down with exit code 1", type(error).__name__, error)
        self.exit_code = 1
        self.should_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._app, self._shutdown_timeout, skip_wait=self._skip_wait)
        finally:
            self.should_exit = True


def run_server(config: ServerConfig) -> int:
    print("pagedserve serve: effective configuration\n" + json.dumps(config.describe(), indent=2, default=str),
          flush=True)
    if config.multi_model:
        return run_multi_model_server(config, build_app)
    tenants = Tenants(config.api_keys) if config.api_keys is not None else None  # a bad file stops us before loading
    engine = LLMEngine(config.engine)
    app = build_app(engine, config, tenants)
    async_engine: AsyncEngine = app.state.engine
    logger.info("serving %s as %s on http://%s:%d; context %d tokens (KV cache holds %d)",
                engine.loaded.name, config.served_model_name or [engine.loaded.name], config.host, config.port,
                async_engine.max_context_len, async_engine.kv_capacity_tokens)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, loop="auto", lifespan="on",
        http=limited_http_protocol(config.max_header_size, config.header_timeout),
        log_level=config.uvicorn_log_level, access_log=not config.disable_uvicorn_access_log,
        # Only sockets still open after the drain are waited for; responses have ended by then.
        timeout_graceful_shutdown=5,
    )
    server = GracefulServer(uv_config, app, config.shutdown_timeout)
    async_engine.on_crash = server.exit_after_crash
    server.run()
    return server.exit_code
