"""OpenAI's Files and Batches routes (/v1/files, /v1/batches) over batch_store.py, and the
batch runner started with the server; Anthropic's Message Batches are anthropic_batch_routes.py.

Everything is stored under --data-dir; without it these routes answer 400 naming the flag.
With --api-keys a tenant sees, reads, deletes and cancels only its own files and batches
(another tenant's id is a 404, as an unknown one is).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from ...http.errors import APIError
from ...http.json_body import StrictModel, parse_body
from ...http.multipart_upload import boundary_of, read_upload
from ...http.openapi import request_body
from .anthropic_batch_routes import CreateMessageBatchRequest, install_anthropic_batches
from .batch_execution import LineExecutor
from .batch_lines import ANTHROPIC_ENDPOINT, BATCH_ENDPOINTS
from .batch_metrics import BatchCollector
from .batch_runner import BatchRunner
from .batch_service import Batches, cancel, find_batch, owner
from .batch_store import BatchRow, BatchStore, FileRow, new_id
from .routes import ServerParts

COMPLETION_WINDOWS = {"24h": 24 * 3600}
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}}}}}}}
_MAX_LIST = 10000


class CreateBatchRequest(StrictModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


def batch_routes(app: FastAPI, parts: ServerParts) -> list[type[BaseModel]]:
    """/v1/files, /v1/batches and /v1/messages/batches; the runner joins the server's lifespan."""
    config = parts.config
    if config.data_dir is None:
        _install_disabled(app)
        return []
    batches = Batches(BatchStore(config.data_dir), None, config.max_batch_file_size, config.batch_storage_quota)
    parts.metrics.registry.register(BatchCollector(batches, parts.model_names[0]))

    async def run_batches() -> None:
        batches.store.remove_strays()
        executor = LineExecutor.from_app(app, (*BATCH_ENDPOINTS, ANTHROPIC_ENDPOINT), app.state.tenants)
        batches.runner = BatchRunner(batches.store, executor, parts.context.admission, config.batch_concurrency)
        await batches.runner.run()

    parts.background.append(run_batches)
    _install_files(app, batches)
    _install_batches(app, batches)
    install_anthropic_batches(app, batches)
    return [CreateBatchRequest, CreateMessageBatchRequest]


def _install_disabled(app: FastAPI) -> None:
    """Plain routes, outside the API document: the API is not served, only explained."""
    async def disabled(request: Request) -> Response:
        raise APIError(400, "this server keeps no files or batches: start it with --data-dir DIR", param="data_dir",
                       code="batches_disabled")

    for path in ("/v1/files", "/v1/files/{rest:path}", "/v1/batches", "/v1/batches/{rest:path}",
                 "/v1/messages/batches", "/v1/messages/batches/{rest:path}"):
        app.router.add_route(path, disabled, methods=["GET", "POST", "DELETE"])


# -- files ------------------------------------------------------------------------------------


def file_object(row: FileRow) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at,
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def _install_files(app: FastAPI, batches: Batches) -> None:
    store = batches.store

    @app.post("/v1/files", openapi_extra=_UPLOAD_BODY)
    async def create_file(request: Request) -> JSONResponse:
        row = await _upload(request, batches, owner())
        return JSONResponse(file_object(row))

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10000, after: str | None = None,
                         order: str = "desc") -> JSONResponse:
        if order != "desc":
            raise APIError(400, f"order must be 'desc' (newest first), got {order!r}", param="order")
        rows = store.list_files(owner(), purpose, _limit(limit), after)
        return JSONResponse(_page([file_object(r) for r in rows], limit))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> JSONResponse:
        return JSONResponse(file_object(_file(store, file_id)))

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        if not store.delete_file(file_id, owner()):
            raise _no_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        row = _file(store, file_id)
        return FileResponse(store.file_path(row.id), media_type="application/octet-stream", filename=row.filename)


async def _upload(request: Request, batches: Batches, who: str) -> FileRow:
    """The upload streamed to disk under the size cap and the owner's quota, then stored."""
    boundary = boundary_of(request.headers.get("content-type", ""))
    cap, why = batches.max_file_size, f"--max-batch-file-size {batches.max_file_size}"
    if batches.storage_quota is not None:
        room = batches.storage_quota - batches.store.stored_bytes(who)
        if room < cap:
            cap, why = max(0, room), f"the storage quota ({batches.storage_quota} bytes, {max(0, room)} left)"
    temp, handle = batches.store.temp_upload()
    try:
        try:
            upload = await read_upload(request.stream(), boundary, handle, max_file_bytes=cap)
        except APIError as e:
            if e.status == 413:
                raise APIError(413, f"the file is over the limit of {why}", param="file", code="file_too_large")
            raise
        if upload.filename is None:
            raise APIError(400, "the body has no 'file' part", param="file")
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch' (the only files this server keeps), got {purpose!r}",
                           param="purpose")
        return await asyncio.to_thread(batches.store.add_file, temp, handle, who, purpose, upload.filename)
    finally:
        handle.close()
        temp.unlink(missing_ok=True)


def _file(store: BatchStore, file_id: str) -> FileRow:
    row = store.get_file(file_id, owner())
    if row is None:
        raise _no_file(file_id)
    return row


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"no file with id {file_id!r}", param="file_id", code="not_found")


def _limit(limit: int) -> int:
    if not 1 <= limit <= _MAX_LIST:
        raise APIError(400, f"limit must be in [1, {_MAX_LIST}], got {limit}", param="limit")
    return limit


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(data) == limit}


# -- batches ----------------------------------------------------------------------------------


def batch_object(store: BatchStore, batch: BatchRow) -> dict[str, Any]:
    counts = store.counts(batch.id)
    times = {f"{status}_at": batch.times.get(status) for status in (
        "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")}
    failed = counts.errored + (len(store.unanswered(batch.id)) if batch.status == "expired" else 0)
    return {"id": batch.id, "object": "batch", "endpoint": batch.endpoint,
            "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
            "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
            "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "created_at": batch.created_at, "expires_at": batch.expires_at, **times,
            "request_counts": {"total": batch.total, "completed": counts.succeeded, "failed": failed},
            "metadata": batch.metadata}


def _install_batches(app: FastAPI, batches: Batches) -> None:
    store = batches.store

    @app.post("/v1/batches", openapi_extra=request_body(CreateBatchRequest))
    async def create_batch(request: Request) -> JSONResponse:
        req = parse_body(await request.body(), CreateBatchRequest)
        who = owner()
        if req.endpoint not in BATCH_ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {list(BATCH_ENDPOINTS)}, got {req.endpoint!r}",
                           param="endpoint")
        if req.completion_window not in COMPLETION_WINDOWS:
            raise APIError(400, f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got "
                                f"{req.completion_window!r}", param="completion_window")
        row = store.get_file(req.input_file_id, who)
        if row is None:
            raise APIError(404, f"no file with id {req.input_file_id!r}", param="input_file_id", code="not_found")
        if row.purpose != "batch":
            raise APIError(400, f"file {row.id} has purpose {row.purpose!r}, not 'batch'", param="input_file_id")
        now = int(time.time())
        batch = BatchRow(new_id("batch_"), who, "openai", req.endpoint, row.id, req.completion_window, "validating",
                         now, now + COMPLETION_WINDOWS[req.completion_window], {}, None, None, 0, req.metadata, None)
        store.add_batch(batch)
        batches.wake()
        return JSONResponse(batch_object(store, batch))

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> JSONResponse:
        rows = store.list_batches(owner(), "openai", _limit(limit), after)
        return JSONResponse(_page([batch_object(store, r) for r in rows], limit))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(batch_object(store, find_batch(store, batch_id, "openai", _no_batch)))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        batch = find_batch(store, batch_id, "openai", _no_batch)
        cancel(batches, batch)
        return JSONResponse(batch_object(store, store.get_batch(batch.id)))


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"no batch with id {batch_id!r}", param="batch_id", code="not_found")
