"""Client disconnects and SSE framing, free of the engine (the router uses them too)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

T = TypeVar("T")
# nginx's "client closed request": logged for requests whose client left first.
CLIENT_CLOSED = 499


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work` unless the client leaves first; then cancel it (which aborts its
    engine requests) and return a 499 no one will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op when it is done
    if task.done() and not task.cancelled():
        return task.result()
    return Response(status_code=CLIENT_CLOSED)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
