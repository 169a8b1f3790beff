"""The routers' OpenAPI documents (/openapi.json).

What a client gets back through a router is a replica's answer, so each route is
documented with the server's own request model and responses
(http/openapi.py), and schemathesis holds the router to the server's
contract. Only the 503 is the router's own: no replica could take the request.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ..http.anthropic_bodies import STREAM_EVENTS, AnthropicErrorResponse, CountTokensRequest, \
    CountTokensResponse, Message, MessagesRequest
from ..http.errors import ANTHROPIC_PATHS
from ..http.openai_bodies import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest, \
    TokenizeRequest
from ..http.openapi import ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse, \
    DetokenizeResponse, ErrorResponse, ModelList, TokenizeResponse, admitted_responses, anthropic_responses, \
    body_responses, build_openapi, generation_responses, get_responses, request_body, responses_api_responses
from ..http.pooling_bodies import EmbeddingRequest, EmbeddingResponse, RerankRequest, RerankResponse, ScoreRequest, \
    ScoreResponse

Responses = dict[int | str, dict[str, Any]]

_NO_REPLICA = {503: {"model": ErrorResponse, "description": "No replica could take the request."}}
# Anthropic's routes answer the router's own errors in Anthropic's shape too (http/errors.py).
_NO_REPLICA_ANTHROPIC = {503: {"model": AnthropicErrorResponse, "description": "No replica could take the request."}}
# Each POST route a router can proxy: the model a replica parses its body with, and what a replica answers.
_POST_ROUTES: dict[str, tuple[type[BaseModel], Responses]] = {
    "/v1/completions": (CompletionRequest, generation_responses(CompletionResponse, CompletionChunk)),
    "/v1/chat/completions": (ChatCompletionRequest, generation_responses(ChatCompletionResponse, ChatCompletionChunk)),
    "/v1/responses": (ResponsesRequest, responses_api_responses()),
    "/tokenize": (TokenizeRequest, body_responses(TokenizeResponse)),
    "/detokenize": (DetokenizeRequest, body_responses(DetokenizeResponse)),
    "/v1/messages": (MessagesRequest, anthropic_responses(Message, AnthropicErrorResponse, STREAM_EVENTS)),
    "/v1/messages/count_tokens": (CountTokensRequest, anthropic_responses(CountTokensResponse, AnthropicErrorResponse)),
    "/v1/embeddings": (EmbeddingRequest, admitted_responses(EmbeddingResponse)),
    "/v1/score": (ScoreRequest, admitted_responses(ScoreResponse)),
    "/v1/rerank": (RerankRequest, admitted_responses(RerankResponse)),
}
# The embedding routes (docs/embeddings.md), proxied by load like the other unkeyed ones.
POOLING_PATHS = ("/v1/embeddings", "/v1/score", "/v1/rerank")
MODELS_RESPONSES: Responses = {**get_responses(ModelList), **_NO_REPLICA}
METRICS_RESPONSES: Responses = get_responses(description="The router's own metrics, Prometheus text format.")


def proxied_post(path: str) -> dict[str, Any]:
    """`add_api_route` keywords documenting a POST route the router proxies to a replica."""
    model, responses = _POST_ROUTES[path]
    no_replica = _NO_REPLICA_ANTHROPIC if path in ANTHROPIC_PATHS else _NO_REPLICA
    return {"methods": ["POST"], "openapi_extra": request_body(model), "responses": {**responses, **no_replica}}


def health_responses(serving: str) -> Responses:
    return {200: {"description": serving}, 503: {"description": "Not serving."}}


def serve_document(app: FastAPI) -> None:
    """Serve the document of the routes added so far (built once: the routes are fixed)."""
    document = build_openapi(app, (ResponsesRequest, MessagesRequest, CountTokensRequest, EmbeddingRequest,
                                        ScoreRequest, RerankRequest))
    app.openapi = lambda: document  # type: ignore[method-assign]
