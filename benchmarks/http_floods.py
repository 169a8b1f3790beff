"""The header-flood and slow-loris probes of docs/reliability.md's advisory table, against a
real `pagedserve serve` (or any server on --url whose PID is --pid), with the server's RSS
before and after each and /health's latency during the slow-loris.

    .venv/bin/python benchmarks/http_floods.py            # starts its own server
    .venv/bin/python benchmarks/http_floods.py --header-mb 500 --sockets 2000
"""
from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server.server_process import read_answer, start_server  # noqa: E402


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def header_flood(port: int, megabytes: int) -> dict:
    """One request whose header block is `megabytes` MB: how much was sent before the
    server answered, and what."""
    chunk = b"a" * (1 << 20)
    sent, started = 0, time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        try:
            for _ in range(megabytes):
                s.sendall(chunk)
                sent += len(chunk)
            s.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_answer(s)
    return {"sent_mib": round(sent / 2**20, 1), "status_line": answer.split(b"\r\n", 1)[0].decode(errors="replace"),
            "seconds": round(time.monotonic() - started, 2)}


def slow_loris(url: str, port: int, sockets: int, seconds: float) -> dict:
    """`sockets` connections each trickling an unfinished header; /health timed meanwhile."""
    held, health = [], []
    try:
        for _ in range(sockets):
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(s)
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            for s in held:
                try:
                    s.sendall(b"a")
                except OSError:
                    pass
            t0 = time.monotonic()
            status = httpx.get(url + "/health", timeout=30).status_code
            health.append((time.monotonic() - t0, status))
            time.sleep(0.2)
        cut = 0
        for s in held:
            s.settimeout(60)
            try:
                cut += s.recv(64).startswith(b"HTTP/1.1 408")
            except OSError:
                pass
    finally:
        for s in held:
            s.close()
    times = sorted(t for t, _ in health)
    return {"sockets": sockets, "health_checks": len(health), "health_all_200": all(c == 200 for _, c in health),
            "health_p50_ms": round(1000 * times[len(times) // 2], 1), "health_max_ms": round(1000 * times[-1], 1),
            "cut_with_408": cut}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--header-mb", type=int, default=500)
    p.add_argument("--sockets", type=int, default=2000)
    p.add_argument("--loris-seconds", type=float, default=10.0)
    p.add_argument("--header-timeout", type=float, default=15.0)
    args = p.parse_args()
    # Both ends hold a descriptor per socket; the server inherits this limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * args.sockets + 256)), hard))
    with tempfile.TemporaryDirectory() as logs:
        server = start_server(Path(logs), "--header-timeout", str(args.header_timeout))
        try:
            pid = server.proc.pid
            out = {"rss_start_mib": round(rss_mib(pid), 1)}
            out["header_flood"] = header_flood(server.port, args.header_mb)
            out["rss_after_flood_mib"] = round(rss_mib(pid), 1)
            out["slow_loris"] = slow_loris(server.url, server.port, args.sockets, args.loris_seconds)
            out["rss_after_loris_mib"] = round(rss_mib(pid), 1)
            out["serves_after"] = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": "Hi", "max_tokens": 2}).status_code
        finally:
            server.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
