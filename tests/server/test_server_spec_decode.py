"""`serve --speculative-config`: drafts are verified behind the API and counted in /metrics."""
from __future__ import annotations

import re

import httpx


def counter(text: str, name: str) -> float:
    match = re.search(rf'^pagedserve:{name}_total{{model_name="[^"]+"}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_completions_with_ngram_speculation_report_acceptance(spec_server, server):
    body = {"prompt": "red green blue red green blue red green blue red", "max_tokens": 16, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        r = client.post(spec_server.url + "/v1/completions", json=body)
        plain = client.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        metrics = client.get(spec_server.url + "/metrics").text
    drafted = counter(metrics, "spec_decode_num_draft_tokens")
    accepted = counter(metrics, "spec_decode_num_accepted_tokens")
    assert drafted > 0 and 0 < accepted <= drafted
    assert re.search(r'spec_decode_num_accepted_tokens_per_pos_total\{model_name="[^"]+",position="0"\} [1-9]', metrics)
