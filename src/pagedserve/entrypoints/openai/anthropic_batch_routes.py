"""Anthropic's Message Batches (/v1/messages/batches) in its shapes, over the same store and
runner as OpenAI's batches: each request's params run through /v1/messages as batch work."""
from __future__ import annotations

import datetime
import functools
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...http.errors import APIError
from ...http.json_body import StrictModel, parse_body
from ...http.openapi import request_body
from .batch_lines import ANTHROPIC_ENDPOINT, anthropic_line, dumps
from .batch_service import Batches, cancel, find_batch, owner
from .batch_store import BatchRow, BatchStore, Line, new_id

_WINDOW_S = 24 * 3600
_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_LIST = 1000
_PROCESSING_STATUS = {"validating": "in_progress", "in_progress": "in_progress", "finalizing": "in_progress",
                      "cancelling": "canceling"}


class BatchRequestItem(StrictModel):
    custom_id: str
    params: dict[str, Any]


class CreateMessageBatchRequest(StrictModel):
    requests: list[BatchRequestItem]


def _rfc3339(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def message_batch(store: BatchStore, batch: BatchRow, base_url: str) -> dict[str, Any]:
    counts = store.counts(batch.id)
    unanswered = batch.total - counts.succeeded - counts.errored
    ended = batch.status not in _PROCESSING_STATUS
    ended_at = next((batch.times[s] for s in ("completed", "cancelled", "expired", "failed") if s in batch.times), None)
    return {
        "id": batch.id, "type": "message_batch", "processing_status": _PROCESSING_STATUS.get(batch.status, "ended"),
        "request_counts": {"processing": 0 if ended else unanswered, "succeeded": counts.succeeded,
                           "errored": counts.errored,
                           "canceled": unanswered if batch.status == "cancelled" else 0,
                           "expired": unanswered if batch.status == "expired" else 0},
        "ended_at": _rfc3339(ended_at), "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at), "archived_at": None,
        "cancel_initiated_at": _rfc3339(batch.times.get("cancelling")),
        "results_url": f"{base_url}/v1/messages/batches/{batch.id}/results" if ended else None,
    }


def _anthropic_errors(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Errors of these routes in Anthropic's shape (the exception handlers answer by exact path)."""
    @functools.wraps(route)  # FastAPI reads the route's parameters through __wrapped__
    async def wrapped(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except APIError as e:
            return JSONResponse(e.anthropic_body(), status_code=e.status, headers=e.headers)
    return wrapped


def install_anthropic_batches(app: FastAPI, batches: Batches) -> None:
    store = batches.store

    def base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    @app.post("/v1/messages/batches", openapi_extra=request_body(CreateMessageBatchRequest))
    @_anthropic_errors
    async def create(request: Request) -> JSONResponse:
        req = parse_body(await request.body(), CreateMessageBatchRequest)
        batch = _new_batch(req)
        store.add_batch(batch, (Line(batch.id, i, item.custom_id, item.params) for i, item in enumerate(req.requests)))
        batches.wake()
        return JSONResponse(message_batch(store, batch, base(request)))

    @app.get("/v1/messages/batches")
    @_anthropic_errors
    async def list_batches(request: Request, limit: int = 20, after_id: str | None = None,
                           before_id: str | None = None) -> JSONResponse:
        if before_id is not None:
            raise APIError(400, "before_id is not supported: page forwards with after_id")
        if not 1 <= limit <= _MAX_LIST:
            raise APIError(400, f"limit must be in [1, {_MAX_LIST}], got {limit}")
        rows = store.list_batches(owner(), "anthropic", limit, after_id)
        data = [message_batch(store, r, base(request)) for r in rows]
        return JSONResponse({"data": data, "has_more": len(data) == limit,
                             "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    @app.get("/v1/messages/batches/{batch_id}")
    @_anthropic_errors
    async def retrieve(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(message_batch(store, find_batch(store, batch_id, "anthropic", _missing), base(request)))

    @app.post("/v1/messages/batches/{batch_id}/cancel")
    @_anthropic_errors
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        batch = find_batch(store, batch_id, "anthropic", _missing)
        cancel(batches, batch)
        return JSONResponse(message_batch(store, store.get_batch(batch.id), base(request)))

    @app.get("/v1/messages/batches/{batch_id}/results")
    @_anthropic_errors
    async def results(batch_id: str) -> Response:
        batch = find_batch(store, batch_id, "anthropic", _missing)
        if batch.status in _PROCESSING_STATUS:
            raise APIError(400, f"batch {batch_id} is still processing; its results are ready once it has ended")
        return StreamingResponse(_result_lines(store, batch), media_type="application/x-jsonl")


def _new_batch(req: CreateMessageBatchRequest) -> BatchRow:
    if not req.requests:
        raise APIError(400, "requests must hold at least one request", param="requests")
    seen: set[str] = set()
    for i, item in enumerate(req.requests):
        if not _CUSTOM_ID.fullmatch(item.custom_id):
            raise APIError(400, f"requests.{i}.custom_id must be 1-64 letters, digits, '_' or '-'")
        if item.custom_id in seen:
            raise APIError(400, f"requests.{i}.custom_id {item.custom_id!r} is used by an earlier request; "
                                "custom_ids must be unique within the batch")
        if item.params.get("stream"):
            raise APIError(400, f"requests.{i}.params.stream: streaming is not supported in a batch")
        seen.add(item.custom_id)
    now = int(time.time())
    return BatchRow(new_id("msgbatch_"), owner(), "anthropic", ANTHROPIC_ENDPOINT, None, "24h", "in_progress", now,
                    now + _WINDOW_S, {"in_progress": now}, None, None, len(req.requests), None, None)


def _result_lines(store: BatchStore, batch: BatchRow) -> Iterator[str]:
    for result in store.results(batch.id):
        yield dumps(anthropic_line(result)) + "\n"
    kind = "expired" if batch.status == "expired" else "canceled"
    for _, custom_id in store.unanswered(batch.id):
        yield dumps({"custom_id": custom_id, "result": {"type": kind}}) + "\n"


def _missing(batch_id: str) -> APIError:
    return APIError(404, f"no message batch with id {batch_id!r}")
