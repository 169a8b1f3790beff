"""SIGTERM: stop admitting (503), let in-flight requests finish within --shutdown-timeout,
abort the rest with finish_reason "abort", exit 0 with no child process left."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from .server_process import start_server

# Long enough for an 8-token request to finish on a loaded 2-core machine; the long
# stream outlives it even at the int8 path's single-stream speed (~200 tok/s).
SHUTDOWN_TIMEOUT_S = 6.0
LONG_FLAGS = ("--max-model-len", "4096", "--kv-cache-memory", "256MiB")


def child_pids(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def test_sigterm_drains_then_aborts_then_exits_0(server_logs):
    server = start_server(server_logs, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *LONG_FLAGS)
    long_events: list[dict] = []
    short_result: dict = {}
    first_token = threading.Event()

    def long_stream():
        body = {"prompt": "An endless story:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    long_events.append(json.loads(line[6:]))
                    first_token.set()
                elif line == "data: [DONE]":
                    long_events.append({"done": True})

    short_started = threading.Event()

    def short_request():
        # Streamed, so its first token says it is running: polling the gauges for two
        # running requests lost the race to an 8-token request on a fast machine.
        body = {"prompt": "Quick:", "max_tokens": 8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    short_started.set()
                    if event["choices"] and event["choices"][0]["finish_reason"]:
                        short_result["finish_reason"] = event["choices"][0]["finish_reason"]
                    if event.get("usage"):
                        short_result["usage"] = event["usage"]

    threads = [threading.Thread(target=long_stream)]
    threads[0].start()
    assert first_token.wait(30)
    threads.append(threading.Thread(target=short_request))
    threads[1].start()
    assert short_started.wait(30)
    children_before = child_pids(server.proc.pid)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    time.sleep(0.5)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503

    for t in threads:
        t.join(60)
    exit_code = server.proc.wait(timeout=30)
    elapsed = time.monotonic() - sent

    assert short_result["finish_reason"] == "length"  # in flight, finished in time
    assert short_result["usage"]["completion_tokens"] == 8
    finishes = [e["choices"][0]["finish_reason"] for e in long_events if "choices" in e and e["choices"]]
    assert finishes[-1] == "abort" and finishes.count("abort") == 1  # cut at the timeout...
    assert long_events[-1] == {"done": True}  # ...and still a well-formed stream
    assert exit_code == 0
    assert SHUTDOWN_TIMEOUT_S <= elapsed < SHUTDOWN_TIMEOUT_S + 15
    assert not [pid for pid in children_before if os.path.exists(f"/proc/{pid}")]
    assert "Traceback" not in server.log()


def test_second_signal_skips_the_wait(server_logs):
    server = start_server(server_logs, "--shutdown-timeout", "120")
    finishes: list[str | None] = []
    first_token = threading.Event()

    def long_stream():
        body = {"prompt": "Go on forever:", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    finishes.append(json.loads(line[6:])["choices"][0]["finish_reason"])
                    first_token.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first_token.wait(30)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGINT)
    exit_code = server.proc.wait(timeout=30)
    thread.join(30)
    assert exit_code == 0 and time.monotonic() - sent < 15
    assert finishes[-1] == "abort"
