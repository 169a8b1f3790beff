"""One HTTP request through an ASGI app in this process, its reply yielded as it is sent:
the replica runs pagedserve's own server app (every route, validation, error shape and
stream) without a socket, and the ingress relays what comes back."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ...router.prompt_keys import NO_KEYS, PromptKeys


@dataclass(frozen=True)
class ProxiedRequest:
    """What the ingress hands a replica; `keys` are for the request router, not the replica."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    keys: PromptKeys = field(default_factory=lambda: NO_KEYS)


@dataclass(frozen=True)
class ReplyStart:
    status: int
    headers: list[tuple[str, str]]


_DONE = object()


async def call_asgi(app: Callable, request: ProxiedRequest) -> AsyncIterator[ReplyStart | bytes]:
    """The reply's start, then its body chunks. Leaving early (the caller was cancelled: its
    client went away) tells the app the client disconnected, which aborts the request."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("pagedserve-replica", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not _DONE:
            if message["type"] == "http.response.start":
                yield ReplyStart(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                     for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait((task,), timeout=5.0)
            task.cancel()
