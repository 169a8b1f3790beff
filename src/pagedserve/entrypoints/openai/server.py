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
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ... import __version__
from ...engine.async_engine import AsyncEngine, EngineDeadError
from ...engine.llm_engine import LLMEngine
from ...http.bounds import limited_http_protocol
from ...http.errors import install_error_handlers
from .args import ServerConfig
from .dashboard import install_dashboard
from .kv_events import install_kv_events
from .lora import install_lora_routes
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import APIKeyMiddleware, BodyLimitMiddleware
from .openapi import ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse, \
    DetokenizeResponse, ModelList, TokenizeResponse, TokenizerInfoResponse, VersionResponse, body_responses, \
    build_openapi, generation_responses, get_responses, request_body, responses_api_responses
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestLimits, \
    TokenizeRequest, check_token_ids, max_prompt_chars, parse_body, validation_error
from .served_models import ServedModels
from .serving import Admission, OpenAIServing, engine_error
from .serving_chat import ChatServing
from .serving_completions import CompletionServing
from .serving_messages import MessagesServing, install_messages_routes
from .serving_responses import ResponsesRequest, ResponsesServing
from .tokenizer_info import tokenizer_info
from .tool_parsers import TOOL_PARSERS
from .tools import template_messages

logger = logging.getLogger("pagedserve.server")

# Tokenising and template rendering run here; two threads keep up with one engine
# on a small machine without starving the engine thread of cores.
_TOKENIZER_THREADS = 2
# After the shutdown timeout, how long aborted responses get to reach their clients.
_ABORTED_RESPONSES_GRACE_S = 5.0


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The ASGI app around `engine`. The engine thread starts and stops with the app's lifespan."""
    model_names = config.served_model_name or [engine.loaded.name]
    metrics = ServerMetrics(model_names[0])
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    metrics.watch(async_engine)
    admission = Admission(async_engine, config.max_queued_requests)
    executor = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="pagedserve-tokenize")
    vocabulary = engine.tokenizer.backend.get_vocab(with_added_tokens=True)
    limits = RequestLimits(config.max_n, config.max_logprobs, async_engine.vocab_size,
                           max_prompt_chars(vocabulary, async_engine.max_context_len))
    models = ServedModels(model_names, engine.list_loras())
    args = (async_engine, admission, limits, models, executor)
    tool_parser = TOOL_PARSERS[config.tool_call_parser] if config.tool_call_parser else None
    completions, common = CompletionServing(*args), OpenAIServing(*args)
    chat = ChatServing(*args, tool_parser=tool_parser)
    responses = ResponsesServing(*args, tool_parser=tool_parser)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.close()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan, redoc_url=None,
                  description="An OpenAI-compatible LLM server.", separate_input_output_schemas=False)
    app.state.engine = async_engine
    app.state.admission = admission

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses=generation_responses(CompletionResponse, CompletionChunk))
    async def create_completion(request: Request) -> Response:
        return await completions.create(request)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(request)

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest), responses=responses_api_responses())
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/models", responses=get_responses(ModelList))
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list",
                             "data": models.cards(created, engine.loaded.name, async_engine.max_context_len)})

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest), responses=body_responses(TokenizeResponse))
    async def tokenize(request: Request) -> JSONResponse:
        req = parse_body(await request.body(), TokenizeRequest)
        common.resolve_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            tokens = await common.off_loop(common.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            tokens = await common.off_loop(chat.render, template_messages(req.messages), req.add_generation_prompt)
        return JSONResponse({"count": len(tokens), "max_model_len": async_engine.max_context_len, "tokens": tokens})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
              responses=body_responses(DetokenizeResponse))
    async def detokenize(request: Request) -> JSONResponse:
        req = parse_body(await request.body(), DetokenizeRequest)
        common.resolve_model(req.model)
        check_token_ids(req.tokens, async_engine.vocab_size, "tokens")
        return JSONResponse({"prompt": await common.off_loop(common.tokenizer.decode, req.tokens)})

    info = tokenizer_info(engine.tokenizer, async_engine.max_context_len)

    @app.get("/tokenizer_info", responses=get_responses(TokenizerInfoResponse))
    async def get_tokenizer_info() -> JSONResponse:
        return JSONResponse(info)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "Serving."},
        503: {"description": "Not serving: shutting down, or the engine stopped or stalled."}})
    async def health() -> Response:
        ok = async_engine.is_healthy and not admission.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=get_responses(description="Prometheus text format."))
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", responses=get_responses(VersionResponse))
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    install_kv_events(app, async_engine)
    request_models: list[type] = [ResponsesRequest]
    request_models += install_messages_routes(app, MessagesServing(*args, tool_parser=tool_parser))
    if engine.config.enable_lora:
        request_models += install_lora_routes(app, async_engine, models)
    if config.dashboard:
        request_models += install_dashboard(app, async_engine, model_names[0], config.dashboard_show_prompts)
    document = build_openapi(app, tuple(request_models))
    app.openapi = lambda: document  # type: ignore[method-assign]  # built once; the routes are fixed
    install_error_handlers(app, {RequestValidationError: validation_error, EngineDeadError: engine_error})
    # Added innermost first: requests pass CORS, then the key check, then the body limit.
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_size)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


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
    engine = LLMEngine(config.engine)
    app = build_app(engine, config)
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
