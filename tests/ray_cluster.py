"""A real two-node Ray cluster on loopback for the tests: a head and a second node (with a
`node2` resource), each `ray start` with 2 CPUs, their own ports and one temp dir.

`ray stop` has no scope (it ends every Ray process of the user on the host, other test
runs' included), so the teardown ends the processes whose command line names this
cluster's temp dir or its GCS address, by pid: SIGTERM, then SIGKILL, every wait bounded.
The nodes run this checkout's pagedserve (PYTHONPATH), as a real cluster runs the
installed package on every node."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")
RAY = str(Path(sys.executable).parent / "ray")
START_TIMEOUT_S = 120
STOP_GRACE_S = 5.0
NODE_CPUS = 2


@dataclass(frozen=True)
class RayCluster:
    address: str  # host:port of the GCS, what RAY_ADDRESS takes
    temp_dir: str
    env: dict[str, str]  # for processes that join it (drivers, `serve run`)

    def pids(self) -> list[int]:
        """This cluster's processes: those whose command line names its temp dir or its GCS
        address, and their descendants (a worker retitles itself `ray::...`)."""
        # Ray passes the GCS address on as IP:port with the host's IP, whatever the head was given.
        marks = (self.temp_dir.encode(), f":{self.address.rpartition(':')[2]}\0".encode())
        parents: dict[int, int] = {}
        found: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if any(m in cmdline for m in marks):
                found.add(int(entry.name))
        grew = True
        while grew:
            children = {pid for pid, parent in parents.items() if parent in found} - found
            found |= children
            grew = bool(children)
        return sorted(found)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports() -> list[str]:
    """Ports a second node on the same host would otherwise share with the first (fixed defaults)."""
    return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]


def _ray_start(args: list[str], env: dict[str, str]) -> None:
    done = subprocess.run([RAY, "start", *args], env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ray start {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


@contextmanager
def ray_cluster() -> Iterator[RayCluster]:
    temp_dir = tempfile.mkdtemp(prefix="psray")  # short: Ray's socket paths live under it
    port = free_port()
    # Explicit: with no mode set, Ray turns token auth on wherever ~/.ray/auth_token exists (a
    # local ray.init() writes one), and a node or driver that disagrees cannot join.
    env = {**os.environ, "PYTHONPATH": SRC, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    cluster = RayCluster(f"127.0.0.1:{port}", temp_dir, {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(NODE_CPUS), "--object-store-memory",
              str(80 << 20), "--disable-usage-stats"]
    try:
        _ray_start(["--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", temp_dir,
                    "--ray-client-server-port", str(free_port()), *common, *_node_ports()], env)
        _ray_start(["--address", cluster.address, "--resources", json.dumps({"node2": 1}), *common, *_node_ports()],
                   env)
        yield cluster
    finally:
        stop(cluster)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop(cluster: RayCluster) -> None:
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        pids = cluster.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while cluster.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not cluster.pids():
            return
    raise RuntimeError(f"Ray processes left behind: {cluster.pids()}")
