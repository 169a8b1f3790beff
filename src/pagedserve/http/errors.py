"""Errors in OpenAI's shape (Anthropic's and Ollama's on their routes), and the one table of exception
handlers the server and the router both install (each adds the conversions of its own
exception types)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_MAX_MESSAGE_CHARS = 1000
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}
# The routes of Anthropic's Messages API: its clients read errors as {"type": "error",
# "error": {"type", "message"}}, with these types.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
# Ollama's API (entrypoints/openai/ollama_routes.py): its clients read errors as {"error": "..."}.
OLLAMA_PATH_PREFIX = "/api/"
_ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error answered in OpenAI's shape, {"error": {"message", "type", "param", "code"}},
    or on Anthropic's routes in its shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message[:_MAX_MESSAGE_CHARS]
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        default = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(self.status, default),
                                           "message": self.message}}

    def ollama_body(self) -> dict[str, Any]:
        """Ollama's shape: the message alone (its clients read `error` as a string)."""
        return {"error": self.message}

    def response(self, path: str = "") -> JSONResponse:
        """The error as an answer to a request for `path` (its shape depends on the API)."""
        if path.startswith(OLLAMA_PATH_PREFIX):
            body = self.ollama_body()
        else:
            body = self.anthropic_body() if path in ANTHROPIC_PATHS else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _http_error(exc: StarletteHTTPException) -> APIError:
    return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def install_error_handlers(app: Starlette, conversions: dict[type[Exception], Callable[[Any], APIError]]) -> None:
    """Every error a route raises answered in the API's shape: APIError as it is, routing's
    HTTP errors (404, 405), `conversions` (an app's own exception types), and anything else
    a 500 whose details go to the log, never to the client."""
    table: dict[type[Exception], Callable[[Any], APIError]] = {
        APIError: lambda exc: exc, StarletteHTTPException: _http_error, **conversions}
    for exc_type, as_api_error in table.items():
        async def handler(request: Request, exc: Exception, as_api_error=as_api_error) -> JSONResponse:
            return as_api_error(exc).response(request.url.path)

        app.add_exception_handler(exc_type, handler)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error").response(request.url.path)

    app.add_exception_handler(Exception, internal_error)
