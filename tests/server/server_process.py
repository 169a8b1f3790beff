"""Start a real `pagedserve serve` process on a free loopback port and wait for /health."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SMALL_SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "1024")
# Every engine shape a server can be started in beyond the default, as its flags: the
# route x shape matrix (test_server_shapes.py) and `make fuzz` start one server of each.
ENGINE_SHAPES = {
    "contiguous": ("--kv-layout", "contiguous"),
    "speculative": ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'),
    "lora": ("--enable-lora",),
    "tp3": ("--tensor-parallel-size", "3"),  # SmolLM2 has 9 heads: 3 ranks
    "pd-producer": ("--kv-transfer-config", '{"kv_connector": "PagedServeConnector", "kv_role": "kv_producer"}'),
    "pd-consumer": ("--kv-transfer-config", '{"kv_connector": "PagedServeConnector", "kv_role": "kv_consumer"}'),
}
STARTUP_TIMEOUT_S = 120.0


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then wait; the return code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def read_answer(s: socket.socket) -> bytes:
    """Everything a server sends on a raw socket until it closes (a reset ends it too)."""
    answer = b""
    try:
        while data := s.recv(65536):
            answer += data
    except ConnectionResetError:
        pass
    return answer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, *flags: str, env: dict[str, str] | None = None,
                 entry: str = "pagedserve.entrypoints.cli", startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 port: int | None = None) -> ServerProcess:
    """Start a server (`python -m entry serve ...`) and wait until /health answers 200;
    `port` restarts one where an earlier one was (default: a free port)."""
    port = port or _free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", entry, "serve", "--port", str(port),
           *SMALL_SERVER_FLAGS, "--uvicorn-log-level", "warning", *flags]
    return _launch("server", cmd, log_path, port, startup_timeout_s, env)


def start_router(log_dir: Path, *flags: str) -> ServerProcess:
    """Start `pagedserve router ...` and wait until its /health answers (it asks a decode instance)."""
    port = _free_port()
    log_path = log_dir / f"router-{port}.log"
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "router", "--port", str(port),
           "--uvicorn-log-level", "warning", *flags]
    return _launch("router", cmd, log_path, port, STARTUP_TIMEOUT_S)


def _launch(kind: str, cmd: list[str], log_path: Path, port: int, timeout_s: float,
            env: dict[str, str] | None = None) -> ServerProcess:
    """Run `cmd`, logging to log_path, until its /health answers 200 (or fail with its log)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, port, log_path)
    if wait_healthy(server.url, timeout_s, lambda: proc.poll() is None):
        return server
    if proc.poll() is not None:
        raise RuntimeError(f"{kind} exited with {proc.returncode}:\n{server.log()[-3000:]}")
    server.stop()
    raise RuntimeError(f"{kind} did not become healthy in {timeout_s} s:\n{server.log()[-3000:]}")


def wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> bool:
    """Poll url/health until it answers 200 (True), the deadline passes or alive() turns false (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False
