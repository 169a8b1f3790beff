"""The Ray commands of docs/scale-out.md, end to end on a two-node cluster of this host
(tests/ray_cluster.py): `pagedserve serve-ray CONFIG.yaml` answers a completion through its
ingress and exits 0 on SIGTERM, and `serve run ...:build_app config=CONFIG.yaml` (Ray's own
CLI) takes the same file."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ray_cluster import RAY, free_port, ray_cluster
from server.server_process import wait_healthy

STARTUP_S = 300.0


def _config(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "app.yaml"
    path.write_text(json.dumps({"engine": {"kv_cache_memory": "64MiB", "num_threads": 1, "max_model_len": 256},
                                "server": {"dashboard": False}, "replicas": {"num_replicas": 1},
                                "http": {"host": "127.0.0.1", "port": port}}))
    return path


def _run_until_healthy(cmd: list[str], env: dict, url: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not wait_healthy(url, STARTUP_S, lambda: proc.poll() is None):
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"{' '.join(cmd[:4])} did not serve:\n{log.read_text()[-4000:]}")
    return proc


def _one_completion(url: str) -> None:
    reply = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=120)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow  # a cluster, then Serve twice with a SmolLM2 replica: ~2 min under load
def test_serve_ray_and_serve_run_take_the_config_file(tmp_path):
    with ray_cluster() as cluster:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _run_until_healthy([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve-ray",
                                   str(_config(tmp_path, port))], cluster.env, url, tmp_path / "serve-ray.log")
        try:
            _one_completion(url)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, (tmp_path / "serve-ray.log").read_text()[-3000:]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = str(Path(RAY).parent / "serve")
        subprocess.run([serve, "start", "--http-host", "127.0.0.1", "--http-port", str(port)], env=cluster.env,
                       check=True, capture_output=True, timeout=STARTUP_S)
        proc = _run_until_healthy([serve, "run", "pagedserve.entrypoints.ray_serve.app:build_app",
                                   f"config={_config(tmp_path, port)}"], cluster.env, url, tmp_path / "serve-run.log")
        try:
            _one_completion(url)
        finally:
            proc.send_signal(signal.SIGINT)  # serve run deletes the app and exits
            proc.wait(120)
