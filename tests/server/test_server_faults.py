"""A fault inside a forward step fails that step's requests with a 500 in the error shape
(streams get it as their last event), /health turns 503, and the server exits 1 within
seconds: never a hang with clients waiting. A SIGKILLed server holds no state a restart
could lose (responses are the only acknowledgement), and a restart serves again."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .faulty_server import FAIL_STEP_ENV
from .server_process import start_server

FAIL_STEP = 25
EXIT_WITHIN_S = 20.0


def test_a_crashing_step_fails_its_requests_with_500_and_the_server_exits_1(server_logs):
    server = start_server(server_logs, env={FAIL_STEP_ENV: str(FAIL_STEP)}, entry="tests.server.faulty_server")
    events: list[dict] = []
    done: list[str] = []
    plain: dict = {}
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "A long story:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done.append(line)
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    started.set()

    def non_stream() -> None:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Another:", "max_tokens": 200,
                                                             "ignore_eos": True}, timeout=60)
        plain.update(status=r.status_code, body=r.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client was left waiting"
    assert started.is_set() and done == ["data: [DONE]"]
    assert events[-1]["error"]["code"] == "engine_crashed" and events[-1]["error"]["type"] == "server_error"
    assert plain["status"] == 500 and set(plain["body"]["error"]) == {"message", "type", "param", "code"}
    assert plain["body"]["error"]["code"] == "engine_crashed"
    assert server.proc.wait(timeout=EXIT_WITHIN_S) == 1
    print(f"fault: clients answered and server exited 1 within {time.monotonic() - start:.1f} s")
    log = server.log()
    assert "fault injected into forward step" in log and "exit code 1" in log


def test_sigkill_then_restart_serves_again(server_logs):
    server = start_server(server_logs)
    first = threading.Event()
    outcome: list[str] = []

    def stream() -> None:
        body = {"prompt": "Go on:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
                for _ in r.iter_lines():
                    first.set()
            outcome.append("ended")
        except httpx.HTTPError as e:
            outcome.append(type(e).__name__)

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(30)
    server.proc.send_signal(signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive() and outcome  # the client learns at once; it does not hang
    restarted = start_server(server_logs)
    try:
        r = httpx.post(restarted.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        assert restarted.stop() == 0
