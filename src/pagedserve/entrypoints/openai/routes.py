"""The server's routes in groups. A group registers its routes on the app and returns
the request models the OpenAPI document adds to the generation ones (openapi.py); the
server (server.py) calls each group in turn, so a new group is one more entry there."""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ... import __version__
from ...http.openai_bodies import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest, \
    TokenizeRequest
from ...http.openapi import ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse, \
    DetokenizeResponse, ModelList, TokenizeResponse, TokenizerInfoResponse, VersionResponse, body_responses, \
    generation_responses, get_responses, post_route, responses_api_responses
from ...http.reasoning_parsers import ReasoningFormat
from ...http.tool_parsers import ToolParser
from .args import ServerConfig
from .dashboard import install_dashboard
from .kv_events_endpoint import install_kv_events
from .lora_endpoints import install_lora_routes
from .metrics import CONTENT_TYPE, ServerMetrics
from .serving import ServingContext
from .serving_chat import ChatServing
from .serving_completions import CompletionServing
from .serving_responses import ResponsesServing
from .serving_tokenize import TokenizeServing
from .tokenizer_info import tokenizer_info


@dataclass(frozen=True, slots=True)
class ServerParts:
    """What the route groups share; built once per app."""

    context: ServingContext
    config: ServerConfig
    metrics: ServerMetrics
    model_names: list[str]  # the names /v1/models lists; the first is the default
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningFormat | None  # --reasoning-parser, or what the chat template writes
    # Tasks a group runs while the server serves (started after the engine, cancelled before it stops).
    background: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


RouteGroup = Callable[[FastAPI, ServerParts], Sequence[type[BaseModel]]]


def openai_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """/v1/completions, /v1/chat/completions, /v1/responses and /v1/models."""
    completions = CompletionServing(parts.context, reasoning_parser=parts.reasoning_parser)
    chat = ChatServing(parts.context, tool_parser=parts.tool_parser, reasoning_parser=parts.reasoning_parser)
    responses = ResponsesServing(parts.context, tool_parser=parts.tool_parser, reasoning_parser=parts.reasoning_parser)
    engine, created = parts.context.engine, int(time.time())

    post_route(app, "/v1/completions", CompletionRequest, generation_responses(CompletionResponse, CompletionChunk),
               "create_completion", completions.create)
    post_route(app, "/v1/chat/completions", ChatCompletionRequest,
               generation_responses(ChatCompletionResponse, ChatCompletionChunk), "create_chat_completion", chat.create)
    post_route(app, "/v1/responses", ResponsesRequest, responses_api_responses(), "create_response", responses.create)

    @app.get("/v1/models", responses=get_responses(ModelList))
    async def list_models() -> JSONResponse:
        cards = parts.context.models.cards(created, engine.engine.loaded.name, engine.max_context_len)
        return JSONResponse({"object": "list", "data": cards})

    return [ResponsesRequest]


def tokenizer_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """/tokenize, /detokenize and /tokenizer_info (vLLM's; lm-eval uses them)."""
    serving = TokenizeServing(parts.context, tool_parser=parts.tool_parser)
    info = tokenizer_info(serving.tokenizer, parts.context.engine.max_context_len)

    post_route(app, "/tokenize", TokenizeRequest, body_responses(TokenizeResponse), "tokenize", serving.tokenize)
    post_route(app, "/detokenize", DetokenizeRequest, body_responses(DetokenizeResponse), "detokenize",
               serving.detokenize)

    @app.get("/tokenizer_info", responses=get_responses(TokenizerInfoResponse))
    async def get_tokenizer_info() -> JSONResponse:
        return JSONResponse(info)

    return []


def operations_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """/health, /metrics and /version: what load balancers and monitoring read."""
    engine, admission = parts.context.engine, parts.context.admission

    @app.get("/health", response_class=Response, responses={
        200: {"description": "Serving."},
        503: {"description": "Not serving: shutting down, or the engine stopped or stalled."}})
    async def health() -> Response:
        ok = engine.is_healthy and not admission.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=get_responses(description="Prometheus text format."))
    async def prometheus_metrics() -> Response:
        return Response(parts.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", responses=get_responses(VersionResponse))
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return []


def kv_event_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    install_kv_events(app, parts.context.engine)
    return []


def lora_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """Only on a server started with --enable-lora."""
    if not parts.context.engine.engine.config.lora.enable_lora:
        return []
    return install_lora_routes(app, parts.context.engine, parts.context.models)


def dashboard_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """Unless --no-dashboard."""
    if not parts.config.dashboard:
        return []
    return install_dashboard(app, parts.context.engine, parts.model_names[0], parts.config.dashboard_show_prompts)
