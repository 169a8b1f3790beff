"""Batch jobs without a server: the input checks, the streamed multipart upload, and the
runner over a store a crash left half-written (resume: every line answered exactly once)."""
from __future__ import annotations

import asyncio
import io
import json
import time
from types import SimpleNamespace

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.entrypoints.openai.batch_execution import LineExecutor
from pagedserve.entrypoints.openai.batch_lines import parse_input
from pagedserve.entrypoints.openai.batch_runner import BatchRunner
from pagedserve.entrypoints.openai.batch_store import BatchRow, BatchStore, Line, LineResult
from pagedserve.http.errors import APIError
from pagedserve.http.multipart_upload import read_upload

CHAT = "/v1/chat/completions"


def _jsonl(*objects: object) -> list[bytes]:
    return [(o if isinstance(o, str) else json.dumps(o)).encode() + b"\n" for o in objects]


def _line(custom_id: str, url: str = CHAT, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"messages": [], **body}}


def test_bad_lines_become_error_results_and_the_rest_run():
    parsed = parse_input("b", (CHAT,), _jsonl(_line("a"), "not json", "[1]", {"method": "POST", "url": CHAT},
                                              _line("u", "/v1/unknown"), _line("s", stream=True), _line("z")))
    assert [line.custom_id for line in parsed.lines] == ["a", "z"]
    assert [(r.idx, r.custom_id, r.error["code"]) for r in parsed.early] == [
        (1, None, "invalid_json_line"), (2, None, "invalid_json_line"), (3, None, "missing_custom_id"),
        (4, "u", "invalid_url"), (5, "s", "invalid_body")]
    assert parsed.errors == []


def test_duplicate_custom_ids_and_an_empty_file_fail_the_batch():
    parsed = parse_input("b", (CHAT,), _jsonl(_line("a"), _line("b"), _line("a")))
    assert [(e["code"], e["line"]) for e in parsed.errors] == [("duplicate_custom_id", 3)]
    assert [e["code"] for e in parse_input("b", (CHAT,), [b"\n", b"  \n"]).errors] == ["empty_file"]


async def _chunks(body: bytes, size: int):
    for start in range(0, len(body), size):
        yield body[start:start + size]


def _multipart(file_body: bytes, purpose: str = "batch") -> bytes:
    return (b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n" + purpose.encode() +
            b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n" + file_body + b"\r\n--XyZ--\r\n")


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 10_000])
def test_upload_streams_the_file_part_whatever_the_chunking(chunk):
    # The file holds a near-boundary ("\r\n--XyZ" less a byte) the parser must not cut at.
    content = b'{"a": 1}\r\n--Xy\r\n' * 5
    sink = io.BytesIO()
    upload = asyncio.run(read_upload(_chunks(_multipart(content), chunk), b"XyZ", sink, max_file_bytes=1000))
    assert (upload.fields, upload.filename, sink.getvalue()) == ({"purpose": "batch"}, "in.jsonl", content)


def test_upload_over_the_cap_is_refused_while_streaming():
    sink = io.BytesIO()
    received = []

    async def chunks():
        body = _multipart(b"x" * 10_000)
        for start in range(0, len(body), 100):
            received.append(start)
            yield body[start:start + 100]

    with pytest.raises(APIError) as e:
        asyncio.run(read_upload(chunks(), b"XyZ", sink, max_file_bytes=500))
    assert e.value.status == 413 and e.value.param == "file"
    assert len(received) < 20  # refused at the cap, not after the whole body
    with pytest.raises(APIError, match="ended before"):
        asyncio.run(read_upload(_chunks(_multipart(b"x")[:-8], 10), b"XyZ", io.BytesIO(), max_file_bytes=500))


def _batch(batch_id: str, total: int, status: str = "in_progress", expires_in: int = 3600) -> BatchRow:
    now = int(time.time())
    return BatchRow(batch_id, "", "openai", CHAT, None, "24h", status, now, now + expires_in, {status: now}, None, None,
                    total, None, None)


def _runner(store: BatchStore, handler, max_in_flight: int = 2) -> BatchRunner:
    return BatchRunner(store, LineExecutor({CHAT: handler}), SimpleNamespace(draining=False), max_in_flight)


async def _echo(request: Request) -> Response:
    body = json.loads(await request.body())
    return JSONResponse({"echo": body["n"]})


def test_resume_answers_each_unanswered_line_once(tmp_path):
    store = BatchStore(tmp_path)
    store.add_batch(_batch("batch_1", 5), [Line("batch_1", i, f"c{i}", {"n": i}) for i in range(5)])
    assert store.record("batch_1", LineResult(1, "c1", 200, "before-1", {"echo": 1}))
    assert not store.record("batch_1", LineResult(1, "c1", 200, "again", {"echo": 1}))  # never twice
    store.record("batch_1", LineResult(3, "c3", 200, "before-3", {"echo": 3}))
    # What a kill -9 leaves: an interrupted upload and the body of an output file whose row was never committed.
    (store.files_dir / ".upload-abc").write_bytes(b"half")
    (store.files_dir / "file-orphan.jsonl").write_bytes(b"{}\n")
    store.close()

    reopened = BatchStore(tmp_path)
    reopened.remove_strays()
    assert list(reopened.files_dir.iterdir()) == []
    calls = []

    async def handler(request: Request) -> Response:
        calls.append(json.loads(await request.body())["n"])
        return JSONResponse({"echo": calls[-1]})

    asyncio.run(_runner(reopened, handler).run_until_done())
    assert sorted(calls) == [0, 2, 4]
    batch = reopened.get_batch("batch_1")
    assert batch.status == "completed" and batch.error_file_id is None
    lines = [json.loads(line) for line in reopened.file_path(batch.output_file_id).read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(5)]
    assert [line["id"] for line in lines if line["custom_id"] in ("c1", "c3")] == ["before-1", "before-3"]
    assert [line["response"]["body"]["echo"] for line in lines] == list(range(5))


def test_refused_lines_are_not_recorded_but_run_again(tmp_path):
    store = BatchStore(tmp_path)
    store.add_batch(_batch("batch_r", 2), [Line("batch_r", i, f"c{i}", {"n": i}) for i in range(2)])
    refusals = [1]

    async def handler(request: Request) -> Response:
        if refusals:
            refusals.pop()
            raise APIError(429, "displaced")
        return await _echo(request)

    asyncio.run(_runner(store, handler, max_in_flight=1).run_until_done())
    assert store.get_batch("batch_r").status == "completed"
    assert [r.status_code for r in store.results("batch_r")] == [200, 200]


def test_cancel_stops_lines_in_flight_and_expiry_fails_the_rest(tmp_path):
    store = BatchStore(tmp_path)
    store.add_batch(_batch("batch_c", 3), [Line("batch_c", i, f"c{i}", {"n": i}) for i in range(3)])
    store.add_batch(_batch("batch_e", 2, expires_in=-1), [Line("batch_e", i, f"e{i}", {"n": i}) for i in range(2)])
    started = asyncio.Event()

    async def stuck(request: Request) -> Response:
        started.set()
        await asyncio.sleep(60)
        raise AssertionError("a cancelled line must not finish")

    async def scenario():
        runner = _runner(store, stuck)
        task = asyncio.ensure_future(runner.run())
        await asyncio.wait_for(started.wait(), 10)
        store.set_status("batch_c", "cancelling", only_from=("in_progress",))
        runner.wake()
        while store.get_batch("batch_c").status != "cancelled":
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(scenario())
    assert list(store.results("batch_c")) == []
    expired = store.get_batch("batch_e")
    assert expired.status == "expired" and expired.output_file_id is None
    errors = [json.loads(line) for line in store.file_path(expired.error_file_id).read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("e0", "batch_expired"), ("e1", "batch_expired")]
