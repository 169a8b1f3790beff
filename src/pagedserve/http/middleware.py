"""ASGI middleware: API-key check and request-body size limit.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware), so streaming responses
and disconnect messages pass through untouched.
"""
from __future__ import annotations

import hashlib
import hmac
import posixpath

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

# The only path served without a key (load balancers probe it without credentials).
# Everything else needs one, /metrics and /openapi.json included, whatever the route
# table says: deny by default, so a new route or an odd spelling of an old one
# (//v1/..., /V1/..., /v1/./..., %2F) cannot be reached without the key. The Host
# header plays no part.
OPEN_PATHS = frozenset({"/health"})
# Where `pagedserve serve` and `pagedserve router` read the key from when --api-key is not given.
API_KEY_ENV = "PAGEDSERVE_API_KEY"


def normalize_path(path: str) -> str:
    """Collapse repeated slashes and dot segments, lower-case, drop a trailing slash."""
    normal = posixpath.normpath("/" + path.lstrip("/")).lower()
    return "/" + normal.lstrip("/")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key_digest = _digest(api_key.encode("utf-8"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and normalize_path(scope["path"]) not in OPEN_PATHS and not self._authorized(scope):
            await unauthorized().response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        # Every presented key is compared (a list, not any()'s early exit).
        return any([self._matches(key) for key in presented_keys(scope)])

    def _matches(self, key: bytes) -> bool:
        # Digests of equal length, compared in constant time: neither the key's bytes nor
        # its length show in how long a wrong key takes to refuse.
        return hmac.compare_digest(_digest(key), self._key_digest)


def presented_keys(scope: Scope) -> list[bytes]:
    """The keys a request presents, as OpenAI's clients send one (a bearer token) or as
    Anthropic's do (x-api-key)."""
    keys = []
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                keys.append(token.strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


def unauthorized() -> APIError:
    return APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BodyLimitMiddleware:
    """Read the whole body first (at most `limit` bytes) and replay it to the app; 413 beyond.
    POSTs to the `streamed` paths pass through as they arrive (their routes cap them)."""

    def __init__(self, app: ASGIApp, limit: int, streamed: frozenset[str] = frozenset()):
        self.app = app
        self._limit = limit
        self._streamed = streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "POST" and scope["path"] in self._streamed):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self._limit:
                await self._too_large(scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._limit:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over the limit of {self._limit} bytes", code="request_too_large")
        await error.response(scope["path"])(scope, receive, send)
