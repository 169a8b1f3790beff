"""The Ray Serve app (entrypoints/ray_serve) on a real two-node Ray cluster on this host
(tests/ray_cluster.py): two SmolLM2 replicas behind one ingress, the replica router's
cache-aware policy as the engine deployment's Serve request router.

Default run: the config file's rules; a multi-tenant shared-prefix workload lands each
prefix on the replica that holds it (the prefix-cache hit rate of the two replicas, read
from their own counters, is printed) while both serve; a request that fails validation
gets the replica's 400. Slow: a replica killed with streams on it fails only those (each
with a clean error), every other request is served, and Serve replaces the replica; P/D as
a prefill and a decode deployment (a second app beside the first) gives the colocated
replicas' greedy tokens, the decode replica pulling the prompts' blocks."""
from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.entrypoints.ray_serve.app import APP_NAME, DECODE_DEPLOYMENT, ENGINE_DEPLOYMENT, build_app, \
    deployments
from pagedserve.entrypoints.ray_serve.replica import REPLICA_HEADER
from pagedserve.entrypoints.ray_serve.settings import RayServeConfig
from pagedserve.workload.datasets import shared_prefix_dataset
from ray_cluster import free_port
from server.server_process import wait_healthy

APP_STARTUP_S = 300.0
REPLACE_BOUND_S = 180.0
CONFIG = {"engine": {"kv_cache_memory": "64MiB", "num_threads": 1, "max_model_len": 512},
          "server": {"dashboard": False},
          "replicas": {"num_replicas": 2, "max_ongoing_requests": 8},
          "router": {"policy": "cache_aware", "stats_period_s": 0.5}}


def test_the_config_file_is_checked_and_build_app_reads_it(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(json.dumps(CONFIG))  # JSON is YAML
    assert type(build_app({"config": str(path)})).__name__ == "Application"
    config = RayServeConfig.load(path)
    assert config.replicas.deployment_options(config.server.engine) == {
        "max_ongoing_requests": 8, "ray_actor_options": {"num_cpus": 1}, "num_replicas": 2}
    scaled = RayServeConfig.from_dict({"replicas": {"max_replicas": 4, "target_ongoing_requests": 2}})
    assert scaled.replicas.deployment_options(scaled.server.engine)["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 2}
    for bad, message in [({"engine": {"kv_cache_mem": 1}}, "unknown key.*kv_cache_mem"),
                         ({"router": {"policy": "random"}}, "router.policy must be one of"),
                         ({"replicas": {"num_replicas": 5, "max_replicas": 4}}, "min_replicas <= num_replicas"),
                         ({"server": {"port": 1}}, "unknown key.*port"), ({"extra": {}}, "unknown key.*extra")]:
        with pytest.raises(ValueError, match=message):
            RayServeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="build_app takes config=PATH or the config's sections"):
        build_app({"config": str(path), "engine": {}})
    with pytest.raises(ValueError, match="unknown key.*model"):
        build_app({"model": "x"})


@pytest.fixture(scope="module")
def app(ray_test_cluster):
    """The app on the session's cluster; this process is its driver."""
    import ray
    from ray import serve

    joined = {k: ray_test_cluster.env[k] for k in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    os.environ.update(joined)
    ray.init()
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployments(RayServeConfig.from_dict(CONFIG)), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert wait_healthy(url, APP_STARTUP_S), "the Serve app did not become healthy"
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        for name in joined:
            del os.environ[name]


def replica_stats(app: str = APP_NAME, deployment: str = ENGINE_DEPLOYMENT) -> dict[str, dict]:
    """Each engine replica's routing stats, asked of its actor directly (the router sees the same)."""
    import ray

    from ray.exceptions import RayError

    stats = {}
    for named in ray.util.list_named_actors(all_namespaces=True):
        if named["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#"):
            try:  # one killed a moment ago may still be listed
                s = ray.get(ray.get_actor(named["name"], namespace="serve").record_routing_stats.remote(), timeout=60)
            except (RayError, ValueError):
                continue
            stats[s["replica"]] = s
    return stats


def complete(url: str, prompt, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_a_shared_prefix_workload_lands_on_the_replica_holding_its_prefix(app):
    requests = shared_prefix_dataset(num_prompts=24, num_groups=4, prefix_len=160, suffix_len=16, output_len=4,
                                     vocab_size=32_000, seed=3)
    before = replica_stats()
    assert len(before) == 2
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda r: complete(app, r.prompt_token_ids), requests))
    assert [r.status_code for r in replies] == [200] * len(requests), [r.text for r in replies if r.status_code != 200]
    landed = [r.headers[REPLICA_HEADER] for r in replies]
    groups = [Counter(landed[g::4]) for g in range(4)]
    on_holder = sum(c.most_common(1)[0][1] for c in groups) / len(requests)
    after = replica_stats()
    hits = sum(after[k]["prefix_cache_hits"] - before[k]["prefix_cache_hits"] for k in after)
    queries = sum(after[k]["prefix_cache_queries"] - before[k]["prefix_cache_queries"] for k in after)
    print(f"prefix groups per replica {[dict(c) for c in groups]}; {on_holder:.0%} of requests on their group's "
          f"replica; prefix-cache hit rate over both replicas {hits / queries:.3f}")
    assert len(set(landed)) == 2, "one replica did all the work"
    assert on_holder >= 0.9
    # A group's first request computes its 160-token prefix; the other five find it: 5/6 of 160/176.
    assert hits / queries >= 0.65
    assert all(len(after[k]["hashes"]) > 0 for k in after)


def test_a_bad_request_gets_the_replicas_400_through_the_ingress(app):
    reply = httpx.post(app + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    models = httpx.get(app + "/v1/models", timeout=60)
    assert models.status_code == 200 and models.json()["data"]


def _stream(url: str, i: int, started: list, outcomes: dict) -> None:
    body = {"prompt": f"Story number {i}:", "max_tokens": 48, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
            replica = r.headers.get(REPLICA_HEADER)
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not lines:
                        started.append((i, replica))
                    lines.append(line[6:])
            outcomes[i] = (r.status_code, replica, lines[-1] if lines else r.read().decode())
    except httpx.HTTPError as e:
        outcomes[i] = (None, None, repr(e))


@pytest.mark.slow  # a replica reloads SmolLM2 after the kill: ~1 min under load
def test_a_killed_replica_fails_only_its_requests_and_is_replaced(app):
    import threading

    stats = replica_stats()
    started: list = []
    outcomes: dict = {}
    threads = [threading.Thread(target=_stream, args=(app, i, started, outcomes)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(started) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = started[0][1]
    on_victim = {i for i, replica in started if replica == victim}
    os.kill(stats[victim]["pid"], signal.SIGKILL)
    after_kill = [complete(app, f"After the kill {i}") for i in range(4)]
    for t in threads:
        t.join(timeout=180)
    failed = {i for i, (status, _, last) in outcomes.items() if not (status == 200 and last == "[DONE]")}
    print(f"killed replica {victim} with {len(on_victim)} streams on it; {len(failed)} failed")
    assert failed <= on_victim, {i: outcomes[i] for i in failed - on_victim}
    for i in failed:  # a clean error: the stream's own error event
        assert json.loads(outcomes[i][2])["error"]["code"] == "backend_failed", outcomes[i]
    assert [r.status_code for r in after_kill] == [200] * 4
    deadline = time.monotonic() + REPLACE_BOUND_S
    while time.monotonic() < deadline:
        now = replica_stats()
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the killed replica was not replaced within {REPLACE_BOUND_S:.0f} s")
    print(f"replaced in {REPLACE_BOUND_S - (deadline - time.monotonic()):.0f} s")
    assert complete(app, "After the replacement").status_code == 200


@pytest.mark.slow  # two more SmolLM2 replicas: ~1 min under load
def test_prefill_and_decode_deployments_give_the_colocated_tokens(app):
    from ray import serve

    pd = {**CONFIG, "disaggregated": {"prefill_replicas": 1, "decode_replicas": 1}}
    serve.run(deployments(RayServeConfig.from_dict(pd)), name="pd", route_prefix="/pd")
    try:
        assert wait_healthy(app + "/pd", APP_STARTUP_S)
        before = replica_stats("pd", DECODE_DEPLOYMENT)
        prompts = [f"Chapter {i}. The lighthouse keeper counted the ships that passed the rocks at night. " * 3
                   for i in range(3)]
        for prompt in prompts:
            want = complete(app, prompt, max_tokens=12)
            got = complete(app + "/pd", prompt, max_tokens=12)
            assert got.status_code == want.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        streamed = httpx.post(app + "/pd/v1/completions", timeout=120, json={
            "prompt": prompts[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True})
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                       if line.startswith("data: ") and line != "data: [DONE]")
        assert text == complete(app, prompts[0], max_tokens=12).json()["choices"][0]["text"]
        after = replica_stats("pd", DECODE_DEPLOYMENT)
        (key,) = after
        received = after[key]["kv_transfer"]["kv_transfer_blocks_received"] - \
            before[key]["kv_transfer"]["kv_transfer_blocks_received"]
        print(f"the decode replica pulled {received} KV blocks from the prefill replica for 4 requests")
        assert after[key]["kv_transfer"]["kv_transfer_loads_failed"] == 0
        assert received >= 4 * 3  # every request's full prompt blocks (3 or more) came over the connector
    finally:
        serve.delete("pd")
