"""One batch line run through the route that serves the same request live (the app's own
handler for /v1/chat/completions, /v1/messages, ...), as batch work: at the background
priority, outside the interactive queue limit, for the tenant that owns the batch."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from ...engine.async_engine import EngineDeadError
from ...http.errors import ANTHROPIC_PATHS, APIError
from ...http.tenants import Tenants, acting_for
from .serving import background_work, engine_error

logger = logging.getLogger("pagedserve.batches")
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Answer:
    status_code: int
    body: dict[str, Any]

    @property
    def retry(self) -> bool:
        """Not the line's own fault (queue full, displaced, shutting down): run it again later."""
        return self.status_code in (429, 503)


class LineExecutor:
    def __init__(self, handlers: Mapping[str, Handler], tenants: Tenants | None = None):
        self._handlers = dict(handlers)
        self._tenants = tenants

    @classmethod
    def from_app(cls, app: FastAPI, paths: Iterable[str], tenants: Tenants | None = None) -> LineExecutor:
        """The handlers of the app's POST routes for `paths`."""
        wanted = set(paths)
        handlers = {route.path: route.endpoint for route in app.routes
                    if isinstance(route, APIRoute) and "POST" in route.methods and route.path in wanted}
        return cls(handlers, tenants)

    def serves(self, path: str) -> bool:
        return path in self._handlers

    async def run(self, path: str, body: dict[str, Any], owner: str = "") -> Answer:
        """The route's answer to `body`: its status and JSON body (an error body in the route's shape)."""
        state = self._tenants.states.get(owner) if self._tenants is not None and owner else None
        with acting_for(state), background_work():
            try:
                response = await self._handlers[path](_request(path, json.dumps(body).encode("utf-8")))
            except APIError as e:
                return _error_answer(path, e)
            except EngineDeadError as e:
                return _error_answer(path, engine_error(e))
            except Exception:  # a bug costs this line, not the batch
                logger.exception("batch line on %s failed", path)
                return _error_answer(path, APIError(500, "internal server error"))
        return Answer(response.status_code, json.loads(response.body))


def _error_answer(path: str, error: APIError) -> Answer:
    return Answer(error.status, error.anthropic_body() if path in ANTHROPIC_PATHS else error.body())


def _request(path: str, body: bytes) -> Request:
    """A POST of `body` to `path` from a client that never leaves."""
    sent = False
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # a batch line has no connection to lose: only cancelling the line ends this
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode("ascii"), "root_path": "",
             "scheme": "http", "query_string": b"", "http_version": "1.1", "server": None, "client": None,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)
