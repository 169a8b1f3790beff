"""Bounds on what one request may ask for: body size (413, readable however the body
is sent), prompt length, n, logprobs, stop strings, logit_bias and constraint size
(400 naming the field). Each refusal leaves the server serving."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from pagedserve.http.openai_bodies import MAX_CONSTRAINT_CHARS, MAX_LOGIT_BIAS_ENTRIES, \
    MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

from .server_process import read_answer, start_server
from .test_server_validation import assert_openai_error

BODY_LIMIT = 1 << 20
MAX_N, MAX_LOGPROBS = 4, 5
TWO_MB = 2_000_000


@pytest.fixture(scope="module")
def limited_server(server_logs):
    proc = start_server(server_logs, "--max-request-body-size", "1MiB", "--max-n", str(MAX_N),
                        "--max-logprobs", str(MAX_LOGPROBS))
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


def _raw_post(port: int, head: bytes, body_chunks: list[bytes], pause_s: float = 0.0) -> bytes:
    """Send a request byte for byte and return everything the server answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        for chunk in body_chunks:
            s.sendall(chunk)
            time.sleep(pause_s)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while data := s.recv(65536):
            answer += data
    return answer


def _assert_readable_413(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code":"request_too_large"' in body and b'"type":"invalid_request_error"' in body


def _body(size: int) -> bytes:
    return b'{"prompt": "' + b"a" * size + b'", "max_tokens": 1}'


@pytest.mark.parametrize("pause_s", [0.0, 0.05], ids=["fast-sender", "slow-sender"])
def test_two_megabyte_body_gets_a_readable_413(limited_server, pause_s):
    """A 2 MB body ended in a connection reset instead of a 413 the client could read."""
    body = _body(TWO_MB)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    chunks = [body[i:i + (256 << 10)] for i in range(0, len(body), 256 << 10)]
    _assert_readable_413(_raw_post(limited_server.port, head, chunks, pause_s))


def test_chunked_body_over_the_limit_gets_a_readable_413(limited_server):
    body = _body(TWO_MB)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    pieces = [body[i:i + (128 << 10)] for i in range(0, len(body), 128 << 10)]
    chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    _assert_readable_413(_raw_post(limited_server.port, head, chunks))


def test_clients_get_the_413_in_the_error_shape(limited_server):
    r = httpx.post(limited_server.url + "/v1/completions", content=_body(TWO_MB),
                   headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, 413)
    assert str(BODY_LIMIT) in r.json()["error"]["message"]
    # Just under the limit is parsed (and refused for its context length, not its size).
    r = httpx.post(limited_server.url + "/v1/completions", content=_body(BODY_LIMIT - 100),
                   headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, 400, "prompt")


MESSAGES = [{"role": "user", "content": "hi"}]
BOUNDS = [
    ("n", {"prompt": "hi", "n": MAX_N + 1}, "n"),
    ("logprobs", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("chat-top-logprobs", {"messages": MESSAGES, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     "top_logprobs"),
    ("stop-count", {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ("stop-length", {"prompt": "hi", "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ("logit-bias-entries", {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
     "logit_bias"),
    ("regex-size", {"prompt": "hi", "guided_regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "guided_regex"),
    ("schema-size", {"prompt": "hi", "guided_json": {"type": "object", "description": "x" * MAX_CONSTRAINT_CHARS}},
     "guided_json"),
    ("choice-size", {"prompt": "hi", "guided_choice": ["y" * 100] * 700}, "guided_choice"),
    ("prompt-characters", {"prompt": "a" * 200_000}, "prompt"),
    ("chat-characters", {"messages": [{"role": "user", "content": "a" * 200_000}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_bounds_are_400s_naming_the_field(limited_server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.monotonic()
    r = httpx.post(limited_server.url + path, json={"max_tokens": 1, **body}, timeout=30)
    assert_openai_error(r, 400, param)
    assert time.monotonic() - start < 5  # refused before any expensive work


def test_the_server_still_serves(limited_server):
    r = httpx.post(limited_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- the header block: bounded in size and in time (http/bounds.py) --------------------

HEADER_LIMIT = 16 << 10
HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def header_bounded_server(server_logs):
    proc = start_server(server_logs, "--max-header-size", str(HEADER_LIMIT), "--header-timeout", str(HEADER_TIMEOUT_S))
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


def _rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def test_a_header_flood_gets_431_unread_and_leaves_memory_alone(header_bounded_server):
    """A single 500 MB header was read whole, answered 200 and kept in memory."""
    pid = header_bounded_server.proc.pid
    before = _rss_bytes(pid)
    chunk = b"a" * (1 << 20)
    sent = 0
    with socket.create_connection(("127.0.0.1", header_bounded_server.port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        try:
            for _ in range(200):  # up to 200 MB; the server stops reading long before
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_answer(s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"code": "request_header_fields_too_large"' in body and b'"type": "invalid_request_error"' in body
    assert sent < 100 << 20, "the server kept reading a header block past its limit"
    assert _rss_bytes(pid) - before < 32 << 20
    # Headers under the limit still pass, and the server serves on.
    ok = httpx.get(header_bounded_server.url + "/v1/models", headers={"X-Fine": "b" * (HEADER_LIMIT // 2)}, timeout=30)
    assert ok.status_code == 200


def test_slow_header_senders_are_cut_off_and_health_answers_meanwhile(header_bounded_server):
    """A slow-loris: sockets trickling a header never finish it. The server closes each with
    408 after --header-timeout, and answers /health promptly all along."""
    port = header_bounded_server.port
    sockets = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            sockets.append(s)
        started = time.monotonic()
        worst = 0.0
        while time.monotonic() - started < HEADER_TIMEOUT_S * 0.75:
            for s in sockets[:50]:
                s.sendall(b"a")  # a byte now and then: never a finished header
            t0 = time.monotonic()
            assert httpx.get(header_bounded_server.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.1)
        assert worst < 1.0, f"/health took {worst:.2f} s during the slow-loris"
        for s in sockets:
            s.settimeout(HEADER_TIMEOUT_S * 3)
            assert read_answer(s).startswith(b"HTTP/1.1 408"), "a slow sender was not cut off"
    finally:
        for s in sockets:
            s.close()
