"""The router in front of two real `pagedserve serve` replicas (one thread each).

- cache_aware on a multi-tenant shared-prefix workload keeps the prefix hit rate of
  the two replicas together (read from their own /metrics) within 90% of one
  instance's, while both replicas serve;
- a replica's KV event stream over HTTP holds the router's keys for a chat request the
  server rendered itself;
- round_robin splits evenly; least_load sends around a replica held busy;
- a replica killed mid-run is skipped (every request still succeeds) and is used
  again once it is back on its port.
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from pagedserve.entrypoints.cli import build_parser
from pagedserve.router.router_command import build_replica_router
from pagedserve.model.sources import load_model_tokenizer
from pagedserve.router.prompt_keys import PromptKeyer
from pagedserve.workload.datasets import shared_prefix_dataset
from server.server_process import ServerProcess, start_server, wait_healthy

REPLICA_FLAGS = ("--num-threads", "1", "--disable-uvicorn-access-log", "--no-dashboard")
ROUTER_STARTUP_S = 30.0


@dataclass
class RouterThread:
    """A router app served by uvicorn on a thread of the test process (replicas are the
    processes here; a router process would only add its start-up time)."""

    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_router(policy: str, backends: list[str]) -> RouterThread:
    args = build_parser().parse_args(["router", "--policy", policy, "--health-interval", "0.5",
                                      "--backend", *backends])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_replica_router(args), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    router = RouterThread(server, thread, port)
    if wait_healthy(router.url, ROUTER_STARTUP_S, thread.is_alive):
        return router
    router.stop()
    raise RuntimeError(f"the {policy} router did not become healthy")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("router-logs")
    procs: dict = {}
    try:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda _: start_server(logs, *REPLICA_FLAGS), range(2))
        procs.update(a=a, b=b)
        backends = [a.url, b.url]
        for policy in ("cache_aware", "round_robin", "least_load"):
            procs[policy] = start_router(policy, backends)
        procs["logs"] = logs
        yield procs
    finally:
        # The routers first: their open connections would hold the replicas' graceful drain.
        for router in [p for p in procs.values() if isinstance(p, RouterThread)]:
            router.stop()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.stop, [p for p in procs.values() if isinstance(p, ServerProcess)]))


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series (its labels filtered by `labels`)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def hit_counters(urls: list[str]) -> tuple[float, float]:
    return (sum(metric(u, "pagedserve:prefix_cache_hits_total") for u in urls),
            sum(metric(u, "pagedserve:prefix_cache_queries_total") for u in urls))


def complete(url: str, prompt, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def run_workload(url: str, prompts: list[list[int]], concurrency: int = 4) -> list[int]:
    with ThreadPoolExecutor(concurrency) as pool:
        return [r.status_code for r in pool.map(lambda p: complete(url, p), prompts)]


def workload(seed: int) -> list[list[int]]:
    return [r.prompt_token_ids for r in shared_prefix_dataset(
        num_prompts=36, num_groups=6, prefix_len=160, suffix_len=16, output_len=4, vocab_size=32_000, seed=seed)]


def routed(router: RouterThread, backend: ServerProcess) -> float:
    return metric(router.url, "pagedserve_router:requests_total", backend=backend.url)


def test_cache_aware_keeps_the_single_instance_hit_rate(cluster):
    a, b, router = cluster["a"], cluster["b"], cluster["cache_aware"]
    hits0, queries0 = hit_counters([a.url])
    assert run_workload(a.url, workload(seed=1)) == [200] * 36
    hits1, queries1 = hit_counters([a.url])
    single = (hits1 - hits0) / (queries1 - queries0)

    before = hit_counters([a.url, b.url])
    per_backend = [routed(router, a), routed(router, b)]
    assert run_workload(router.url, workload(seed=2)) == [200] * 36  # new prefixes: nothing cached yet
    after = hit_counters([a.url, b.url])
    cluster_rate = (after[0] - before[0]) / (after[1] - before[1])
    split = [routed(router, a) - per_backend[0], routed(router, b) - per_backend[1]]
    assert sum(split) == 36
    assert min(split) >= 6, f"one replica did nearly all the work: {split}"
    assert single > 0.5, f"the workload should be mostly cached prefixes on one instance, got {single:.2f}"
    assert cluster_rate >= 0.9 * single, f"cache_aware across 2 replicas {cluster_rate:.3f} vs one {single:.3f}"
    assert metric(router.url, "pagedserve_router:known_cached_blocks") > 0, "no KV events reached the router"


def test_kv_events_over_http_hold_the_router_keys_of_a_chat(cluster):
    a = cluster["a"]
    messages = [{"role": "system", "content": "You answer questions about block tables. " * 8},
                {"role": "user", "content": "How are blocks freed?"}]
    reply = httpx.post(a.url + "/v1/chat/completions", timeout=120,
                       json={"messages": messages, "max_tokens": 2, "cache_salt": "t1"})
    assert reply.status_code == 200
    keyer = PromptKeyer(load_model_tokenizer(None))
    keys = keyer.keys("/v1/chat/completions", json.dumps({"messages": messages, "cache_salt": "t1"}).encode())
    hashes = {h.hex() for h in keys.hashes(16)}
    assert len(hashes) >= 4
    with httpx.stream("GET", a.url + "/v1/kv_events", timeout=30) as events:
        line = next(line for line in events.iter_lines() if line.startswith("data: "))
    snapshot = json.loads(line[6:])
    assert snapshot["type"] == "snapshot" and hashes <= set(snapshot["hashes"])


def test_round_robin_splits(cluster):
    a, b, router = cluster["a"], cluster["b"], cluster["round_robin"]
    before = [routed(router, a), routed(router, b)]
    for i in range(8):
        assert complete(router.url, [100 + i] * 20, max_tokens=2).status_code == 200
    assert [routed(router, a) - before[0], routed(router, b) - before[1]] == [4, 4]


def test_anthropic_messages_pass_through_the_router(cluster):
    """/v1/messages through the router: the replica's message, its event stream and its
    errors, all in Anthropic's shape, the same as from the replica itself."""
    router, a = cluster["round_robin"], cluster["a"]
    body = {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Name a colour."}]}
    direct = httpx.post(a.url + "/v1/messages", json=body, timeout=60).json()
    via = httpx.post(router.url + "/v1/messages", json=body, timeout=60).json()
    assert via["type"] == "message" and via["content"] == direct["content"] and via["usage"] == direct["usage"]
    with httpx.stream("POST", router.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    counted = httpx.post(router.url + "/v1/messages/count_tokens", json={"messages": body["messages"]}, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] == direct["usage"]["input_tokens"]
    bad = httpx.post(router.url + "/v1/messages", json={"messages": body["messages"]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_least_load_sends_around_a_busy_replica(cluster):
    a, b, router = cluster["a"], cluster["b"], cluster["least_load"]
    before = [routed(router, a), routed(router, b)]
    body = {"prompt": [5] * 20, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as long_reply:
        lines = long_reply.iter_lines()  # held: a dropped iterator closes the response
        next(lines)  # it is running on one of them
        busy = a if routed(router, a) > before[0] else b
        idle = b if busy is a else a
        for i in range(4):
            assert complete(router.url, [200 + i] * 20, max_tokens=2).status_code == 200
        assert routed(router, idle) - before[idle is b] == 4
        assert routed(router, busy) - before[busy is b] == 1
        del lines
    # Leaving the stream early closed the connection: the replica aborted the request.
    deadline = time.monotonic() + 30
    while metric(busy.url, "pagedserve:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(busy.url, "pagedserve:num_requests_running") == 0


def test_a_killed_replica_is_skipped_and_used_again_after_restart(cluster):
    b, router = cluster["b"], cluster["least_load"]
    prompts = [[300 + i] * 40 for i in range(16)]
    with ThreadPoolExecutor(4) as pool:
        replies = [pool.submit(complete, router.url, p, 16) for p in prompts]
        while sum(f.done() for f in replies) < 3:
            time.sleep(0.05)
        b.proc.send_signal(signal.SIGKILL)  # mid-run: some requests are on it now
        b.proc.wait()
        codes = [f.result().status_code for f in replies]
    assert codes == [200] * 16
    assert metric(router.url, "pagedserve_router:healthy", backend=b.url) == 0
    for i in range(4):  # while it is down, everything goes to the survivor
        assert complete(router.url, [400 + i] * 20, max_tokens=2).status_code == 200

    restarted = start_server(cluster["logs"], *REPLICA_FLAGS, port=b.port)
    cluster["b"] = restarted
    deadline = time.monotonic() + 30
    while metric(router.url, "pagedserve_router:healthy", backend=b.url) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    before = routed(router, restarted)
    for i in range(6):
        assert complete(router.url, [500 + i] * 20, max_tokens=2).status_code == 200
    assert routed(router, restarted) - before >= 2, "the restarted replica was not used again"
    assert metric(router.url, "pagedserve_router:retries_total") >= 1
