"""Batch jobs on a real server, driven by the official openai and anthropic clients: files,
batches and message batches, bad input, tenants' ownership and quota, priority admission
under a full queue, and (slow) a server killed with SIGKILL mid-batch and restarted."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .server_process import ServerProcess, start_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

KEYS = {"alice": "sk-alice-batches", "bob": "sk-bob-batches"}
MAX_FILE = 8192
QUOTA = 64 * 1024
QUEUE = 4
FINAL = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def batch_server(server_logs, tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("batches")
    keys = root / "keys.json"
    keys.write_text(json.dumps({"tenants": {"alice": {}, "bob": {}},
                                "keys": [{"tenant": t, "key": k} for t, k in KEYS.items()]}))
    proc = start_server(server_logs, "--data-dir", str(root / "data"), "--api-keys", str(keys),
                        "--max-batch-file-size", str(MAX_FILE), "--batch-storage-quota", str(QUOTA),
                        "--scheduling-policy", "priority", "--max-queued-requests", str(QUEUE),
                        "--max-num-seqs", "2")
    yield proc
    proc.stop()


def _openai(server: ServerProcess, tenant: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def _anthropic(server: ServerProcess, tenant: str = "alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[tenant], max_retries=0, timeout=60)


def _chat_line(custom_id: str, content: str = "Hi", max_tokens: int = 3) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}}


def _jsonl(*lines: dict | str) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def _wait(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_its_good_lines_and_reports_the_bad_ones(batch_server):
    client = _openai(batch_server)
    body = _jsonl(_chat_line("ok-1"), "{not json", _chat_line("ok-2"),
                  {**_chat_line("wrong-url"), "url": "/v1/audio/speech"},
                  {**_chat_line("bad-body"), "body": {"messages": "nope"}})
    upload = client.files.create(file=("in.jsonl", body), purpose="batch")
    assert (upload.purpose, upload.bytes) == ("batch", len(body))
    assert upload.id in [f.id for f in client.files.list()]
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = _wait(client, batch.id)
    assert done.status == "completed"
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 2, 3)
    output = _lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == ["ok-1", "ok-2"]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
    errors = {line["custom_id"]: line for line in _lines(client, done.error_file_id)}
    assert errors[None]["error"]["code"] == "invalid_json_line"
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    # Refused by the endpoint itself: its own 400, as the live route answers it.
    assert errors["bad-body"]["response"]["status_code"] == 400
    assert errors["bad-body"]["response"]["body"]["error"]["param"] == "messages"
    assert done.id in [b.id for b in client.batches.list()]


def test_completions_and_embeddings_batches_run_through_their_routes(batch_server):
    client = _openai(batch_server)
    for endpoint, body, kind in (("/v1/completions", {"prompt": "Once", "max_tokens": 2}, "text_completion"),
                                 ("/v1/embeddings", {"input": "hello"}, "list")):
        line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
        upload = client.files.create(file=("in.jsonl", _jsonl(line)), purpose="batch")
        done = _wait(client, client.batches.create(input_file_id=upload.id, endpoint=endpoint,
                                                   completion_window="24h").id)
        assert [out["response"]["body"]["object"] for out in _lines(client, done.output_file_id)] == [kind]


def test_duplicate_custom_ids_fail_the_batch_at_validation(batch_server):
    client = _openai(batch_server)
    upload = client.files.create(file=("dup.jsonl", _jsonl(_chat_line("same"), _chat_line("same"))), purpose="batch")
    done = _wait(client, client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert done.status == "failed" and done.failed_at
    assert [(e.code, e.line) for e in done.errors.data] == [("duplicate_custom_id", 2)]
    assert done.output_file_id is None


def test_bad_requests_are_refused_in_openai_shape(batch_server):
    client = _openai(batch_server)
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE + 1)), purpose="batch")
    assert e.value.status_code == 413 and "max-batch-file-size" in e.value.message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", _jsonl(_chat_line("a"))), purpose="fine-tune")
    upload = client.files.create(file=("in.jsonl", _jsonl(_chat_line("a"))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/audio/speech", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")
    for call in (lambda: client.files.retrieve("file-unknown"), lambda: client.files.delete("file-unknown"),
                 lambda: client.files.content("file-unknown"), lambda: client.batches.retrieve("batch_unknown"),
                 lambda: client.batches.cancel("batch_unknown"),
                 lambda: client.batches.create(input_file_id="file-unknown", endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error"


def test_a_file_deleted_while_its_batch_runs_does_not_stop_it(batch_server):
    client = _openai(batch_server)
    upload = client.files.create(file=("in.jsonl", _jsonl(*(_chat_line(f"l{i}") for i in range(3)))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait(client, batch.id, ("in_progress", *FINAL))
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3


def test_cancel_twice(batch_server):
    client = _openai(batch_server)
    upload = client.files.create(
        file=("in.jsonl", _jsonl(*(_chat_line(f"c{i}", max_tokens=40) for i in range(8)))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    first = client.batches.cancel(batch.id)
    assert first.status in ("cancelling", "cancelled")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts.completed < 8
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_finished_batch(client))


def _finished_batch(client: openai.OpenAI) -> str:
    upload = client.files.create(file=("in.jsonl", _jsonl(_chat_line("f"))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    return _wait(client, batch.id).id


def test_tenants_see_only_their_own_files_and_batches(batch_server):
    alice, bob = _openai(batch_server, "alice"), _openai(batch_server, "bob")
    upload = alice.files.create(file=("in.jsonl", _jsonl(_chat_line("a"))), purpose="batch")
    batch = alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert upload.id not in [f.id for f in bob.files.list()]
    assert batch.id not in [b.id for b in bob.batches.list()]
    for call in (lambda: bob.files.retrieve(upload.id), lambda: bob.files.content(upload.id),
                 lambda: bob.files.delete(upload.id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.files.retrieve(upload.id).id == upload.id
    with pytest.raises(anthropic.NotFoundError):
        _anthropic(batch_server, "bob").messages.batches.retrieve(
            _anthropic(batch_server, "alice").messages.batches.create(requests=[_message_request("m", "any")]).id)


def test_the_storage_quota_counts_each_tenants_files(batch_server):
    bob = _openai(batch_server, "bob")
    kept = []
    with pytest.raises(openai.APIStatusError) as e:
        for i in range(QUOTA // MAX_FILE + 1):
            kept.append(bob.files.create(file=(f"{i}.jsonl", b"x" * MAX_FILE), purpose="batch").id)
    assert e.value.status_code == 413 and "quota" in e.value.message
    bob.files.delete(kept[0])
    bob.files.create(file=("again.jsonl", b"x" * 100), purpose="batch")
    for file_id in kept[1:]:
        bob.files.delete(file_id)


def _message_request(custom_id: str, model: str, max_tokens: int = 3) -> dict:
    return {"custom_id": custom_id, "params": {"model": model, "max_tokens": max_tokens,
                                               "messages": [{"role": "user", "content": "Hi"}]}}


def test_anthropic_message_batches(batch_server):
    client = _anthropic(batch_server)
    served = _openai(batch_server).models.list().data[0].id
    good = _message_request("good", served)
    bad = {"custom_id": "bad", "params": {"model": served, "messages": []}}  # no max_tokens
    batch = client.messages.batches.create(requests=[good, bad])
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 2
    deadline = time.monotonic() + 120
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (1, 1)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["good"].type == "succeeded" and results["good"].message.role == "assistant"
    assert results["bad"].type == "errored" and results["bad"].error.error.type == "invalid_request_error"
    assert batch.id in [b.id for b in client.messages.batches.list()]


def test_anthropic_cancel_and_bad_requests(batch_server):
    client = _anthropic(batch_server)
    served = _openai(batch_server).models.list().data[0].id
    batch = client.messages.batches.create(requests=[_message_request(f"r{i}", served, 40) for i in range(6)])
    assert client.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
    assert client.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
    deadline = time.monotonic() + 60
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    kinds = [r.result.type for r in client.messages.batches.results(batch.id)]
    assert len(kinds) == 6 and "canceled" in kinds
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        client.messages.batches.create(requests=[_message_request("same", served), _message_request("same", served)])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.batches.retrieve("msgbatch_unknown")
    assert e.value.body["error"]["type"] == "not_found_error"


def test_batch_metrics(batch_server):
    text = httpx.get(batch_server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"}).text
    for name in ("batch_lines_queued", "batch_lines_running", "batch_lines_finished_total"):
        assert f"pagedserve:{name}{{" in text


def test_an_urgent_request_displaces_waiting_work_from_a_full_queue(batch_server):
    """max-num-seqs 2 and a queue of 4: long priority-5 requests, sent one by one, fill it
    until the next is refused (it outranks nothing waiting); a priority -10 chat is then
    admitted and answered, and the latest waiting priority-5 request is displaced (429)."""
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}

    async def scenario():
        async with httpx.AsyncClient(base_url=batch_server.url, headers=headers, timeout=120) as http:
            flood: list[asyncio.Future] = []
            deadline = time.monotonic() + 60
            while not any(task.done() and task.result().status_code == 429 for task in flood):
                assert time.monotonic() < deadline, "the flood never filled the queue"
                flood.append(asyncio.ensure_future(http.post("/v1/completions", json={
                    "prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True, "priority": 5})))
                await asyncio.sleep(0.3)
            urgent = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": -10})
            answered = [task.result() for task in flood if task.done()]
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            return urgent, answered

    urgent, answered = asyncio.run(scenario())
    assert urgent.status_code == 200, urgent.text
    assert urgent.json()["choices"][0]["message"]["content"] is not None
    refusals = [r.json()["error"]["message"] for r in answered if r.status_code == 429]
    assert any("already waiting" in m for m in refusals)
    assert any("displaced" in m for m in refusals)


@pytest.mark.slow
def test_a_batch_survives_kill_9_and_each_line_is_answered_once(server_logs, tmp_path):
    data = tmp_path / "data"
    first = start_server(server_logs, "--data-dir", str(data), "--batch-concurrency", "2")
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        upload = client.files.create(file=("in.jsonl", _jsonl(*(_chat_line(f"k{i}", f"Count {i}", 12)
                                                                  for i in range(10)))), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    finally:
        first.stop()
    before = _recorded(data / "batches.sqlite3", batch.id)
    assert 2 <= len(before) < 10
    second = start_server(server_logs, "--data-dir", str(data))
    try:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = _wait(client, batch.id)
        output = _lines(client, done.output_file_id)
    finally:
        second.stop()
    assert done.status == "completed" and done.request_counts.completed == 10
    assert sorted(line["custom_id"] for line in output) == sorted(f"k{i}" for i in range(10))
    # Lines answered before the kill keep their answers: none ran twice.
    assert {line["custom_id"]: line["id"] for line in output if line["custom_id"] in before} == before
    assert not [p for p in os.listdir(data / "files") if p.startswith(".upload-")]


def _recorded(db: Path, batch_id: str) -> dict[str, str]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT custom_id, request_id FROM results WHERE batch_id = ?", (batch_id,)))


def test_without_data_dir_the_routes_name_the_flag(http):
    for method, path in (("GET", "/v1/files"), ("POST", "/v1/batches"), ("GET", "/v1/messages/batches/x")):
        response = http.request(method, path)
        assert response.status_code == 400 and "--data-dir" in response.json()["error"]["message"]
