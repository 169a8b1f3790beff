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


def named_sse(payload: dict[str, Any]) -> str:
    """One server-sent event named by its payload's type, as Anthropic's stream is."""
    return f"event: {payload['type']}\n{sse(payload)}"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or a 499 no one will read if the client leaves first."""
    result = await unless_disconnected(request, work)
    return Response(status_code=CLIENT_CLOSED) if result is None else result


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result (never None), or None if the client leaves first: then `work` is
    cancelled, which aborts its engine requests or closes its upstream request, and
    waited for until it has wound up."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op when it is done
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.wait((task,))
    return None


async def disconnected(receive: Receive) -> None:
    """Return when the client has left (the other messages are a body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
