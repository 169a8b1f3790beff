"""What a client can talk to: one `pagedserve serve` in an engine shape, or `pagedserve
router` in one of its modes in front of real servers. The fuzz script and the tests
start them by shape name."""
from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .server_process import ENGINE_SHAPES, ServerProcess, start_router, start_server


@dataclass(frozen=True)
class RouterShape:
    server_shapes: tuple[str, ...]  # the engine shape of each server behind the router
    flags: Callable[[Sequence[str]], tuple[str, ...]]  # the router's flags, from those servers' URLs


ROUTER_SHAPES = {
    "router-replica": RouterShape(("default", "default"), lambda urls: (
        "--policy", "cache_aware", "--health-interval", "0.5", "--backend", *urls)),
    "router-disagg": RouterShape(("pd-producer", "pd-consumer"), lambda urls: (
        "--prefill", urls[0], "--decode", urls[1])),
}
SHAPES = ("default", *ENGINE_SHAPES, *ROUTER_SHAPES)


@dataclass
class Deployment:
    front: ServerProcess  # what clients call: the server, or the router
    servers: list[ServerProcess] = field(default_factory=list)  # behind the router

    @property
    def url(self) -> str:
        return self.front.url

    @property
    def processes(self) -> list[ServerProcess]:
        return [self.front, *self.servers]

    def healthy(self) -> bool:
        """Every process alive and answering /health with 200."""
        return all(p.proc.poll() is None and _health(p.url) == 200 for p in self.processes)

    def stop(self) -> list[int]:
        """SIGTERM to the front first, then to the servers; their exit codes in that order."""
        return [p.stop() for p in self.processes]

    def stopped_cleanly(self, exit_codes: list[int]) -> bool:
        """Every process exited as after a graceful shutdown: a server with 0, a router with 0
        or by SIGTERM itself (uvicorn re-raises the signal once it has shut down)."""
        router_codes = (0, -signal.SIGTERM) if self.servers else (0,)
        return exit_codes[0] in router_codes and not any(exit_codes[1:])

    def log(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in self.processes)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return None


def start_deployment(log_dir: Path, shape: str, *server_flags: str) -> Deployment:
    """`shape` started with `server_flags` on every server; a router shape's servers start
    at once, then the router in front of them."""
    if shape not in ROUTER_SHAPES:
        return Deployment(start_server(log_dir, *server_flags, *ENGINE_SHAPES.get(shape, ())))
    router = ROUTER_SHAPES[shape]
    with ThreadPoolExecutor(len(router.server_shapes)) as pool:
        futures = [pool.submit(start_server, log_dir, *server_flags, *ENGINE_SHAPES.get(s, ()))
                   for s in router.server_shapes]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < len(futures):
            raise next(f.exception() for f in futures if f.exception() is not None)
        return Deployment(start_router(log_dir, *router.flags([s.url for s in started])), started)
    except BaseException:
        for server in started:
            server.stop()
        raise
