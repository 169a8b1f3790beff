"""examples/grafana/pagedserve.json queries only metrics that pagedserve's /metrics serves."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "pagedserve.json"
METRIC = re.compile(r"pagedserve:[a-z0-9_]+")
SERIES = re.compile(r"^(pagedserve:[a-z0-9_]+)[{ ]", re.M)


def queried_metrics(node: object) -> set[str]:
    """Every pagedserve:* name in any expression or query of the dashboard."""
    if isinstance(node, dict):
        return set().union(*(queried_metrics(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(queried_metrics(v) for v in node))
    return set(METRIC.findall(node)) if isinstance(node, str) else set()


def test_every_queried_metric_is_served(server, spec_server):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])
    queried = queried_metrics(dashboard)
    # The engine's series appear once it has run a step; spec_decode_* only with speculation on.
    body = {"prompt": "one two one two one two", "max_tokens": 4}
    assert httpx.post(spec_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    served = set()
    for proc in (server, spec_server):
        served |= set(SERIES.findall(httpx.get(proc.url + "/metrics", timeout=10).text))
    assert queried - served == set()
    # Every panel family is covered: latency histograms, KV cache, queues, prefix cache, speculation.
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "kv_cache_usage_perc", "num_requests_waiting",
                 "num_preemptions_total", "prefix_cache_hits_total", "spec_decode_num_accepted_tokens_total"):
        assert "pagedserve:" + name in queried
