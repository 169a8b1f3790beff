"""--api-keys: tenants on a real server. Keys name tenants; budgets answer 429 with Retry-After
in the route's shape; a tenant's priority class preempts; prefix-cache blocks are shared within
a tenant only; /metrics counts per tenant; SIGHUP reloads the file. The server runs one
request at a time (--max-num-seqs 1) under --scheduling-policy priority, so who waits is clear."""
from __future__ import annotations

import functools
import hashlib
import signal
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.http.tenant_keys import hash_key

from .server_process import start_server

KEYS = {"open": "sk-open-7a1", "bulk": "sk-bulk-2c9", "urgent": "sk-urgent-5d0", "limited": "sk-lim-9e3",
        "small": "sk-small-4b8", "single": "sk-single-1f6", "other": "sk-other-8a2"}
NEW_KEY = "sk-open-rotated-3e7"
TENANTS = """
tenants:
  open: {}
  other: {}
  bulk: {priority: 10}
  urgent: {priority: 0}
  limited: {rpm: 2}
  small: {tpm: 6}
  single: {max_concurrency: 1}
"""
COUNT = "Count from 1 to 500, separated by commas: 1, 2, 3, 4,"


def keys_yaml(keys: dict[str, str]) -> str:
    # Hashes for all but one, which the file holds in the clear (hashed on load).
    lines = [f'  - {{tenant: {t}, key_sha256: "{hash_key(k)}"}}' for t, k in keys.items() if t != "other"]
    return TENANTS + "keys:\n" + "\n".join(lines) + f'\n  - {{tenant: other, key: "{keys["other"]}"}}\n'


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    path.write_text(keys_yaml(KEYS))
    return path


@pytest.fixture(scope="module")
def tenant_server(server_logs, keys_path):
    proc = start_server(server_logs, "--api-keys", str(keys_path), "--scheduling-policy", "priority",
                        "--max-num-seqs", "1")
    yield proc
    proc.stop()


@functools.cache
def model_of(url: str) -> str:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS["open"], max_retries=0).models.list().data[0].id


def oai(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


def claude(server, tenant: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[tenant], max_retries=0, timeout=120)


def tenant_metrics(server) -> dict[tuple[str, ...], float]:
    """(sample name, tenant[, budget]) -> value, and (sample name,) for the engine-wide ones."""
    text = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {KEYS['open']}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix("pagedserve:")
            key = (name, *(s.labels[k] for k in ("tenant", "budget") if k in s.labels))
            out[key] = s.value
    return out


def test_each_key_opens_the_api_for_its_tenant(tenant_server):
    r = oai(tenant_server, "open").completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    message = claude(tenant_server, "other").messages.create(
        model=model_of(tenant_server.url), max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tenant_server.url + "/v1", api_key="sk-nobody", max_retries=0).models.list()
    assert httpx.get(tenant_server.url + "/health").status_code == 200
    m = tenant_metrics(tenant_server)
    assert m[("tenant_requests_total", "open")] == 1 and m[("tenant_requests_total", "other")] == 1
    assert m[("tenant_prompt_tokens_total", "open")] == r.usage.prompt_tokens
    assert m[("tenant_generation_tokens_total", "open")] == r.usage.completion_tokens


def test_spent_rpm_is_a_429_with_retry_after_in_each_api_shape(tenant_server):
    client = oai(tenant_server, "limited")
    for _ in range(2):
        client.completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=1)
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 30
    assert info.value.body["code"] == "rate_limit_exceeded" and "2 requests a minute" in info.value.body["message"]
    with pytest.raises(anthropic.RateLimitError) as info:
        claude(tenant_server, "limited").messages.create(
            model=model_of(tenant_server.url), max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "rate_limit_error"
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 30
    # Counting tokens or listing models generates nothing and is not metered.
    assert client.models.list().data
    m = tenant_metrics(tenant_server)
    assert m[("tenant_rate_limited_total", "limited", "rpm")] == 2
    assert m[("tenant_requests_total", "limited")] == 2


def test_streamed_tokens_overdraw_tpm_and_cut_the_tenant_off(tenant_server):
    client = oai(tenant_server, "small")
    stream = client.completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=20, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][0]
    assert usage.completion_tokens == 20
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=1)
    # 6 tokens a minute, a token every 10 s, ~15 charged beyond the bucket: up to 160 s, less
    # what refilled while the 20 tokens streamed.
    assert 30 <= int(info.value.response.headers["retry-after"]) <= 200
    m = tenant_metrics(tenant_server)
    assert m[("tenant_generation_tokens_total", "small")] == 20
    assert m[("tenant_rate_limited_total", "small", "tpm")] == 1
    assert m[("tenant_budget_remaining", "small", "tpm")] < 0


def test_the_concurrency_cap_holds_while_a_response_streams(tenant_server):
    client = oai(tenant_server, "single")
    stream = client.completions.create(model=model_of(tenant_server.url), prompt=COUNT, max_tokens=64, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=1)
    assert info.value.response.headers["retry-after"] == "1"
    stream.close()
    deadline = time.monotonic() + 30
    while tenant_metrics(tenant_server)[("tenant_requests_in_flight", "single")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.completions.create(model=model_of(tenant_server.url), prompt="hi", max_tokens=1).choices


def _preempts(server, start_bulk, urgent) -> bool:
    """Start a long low-priority stream, then an urgent request: did the urgent one preempt it?"""
    before = tenant_metrics(server)[("num_preemptions_total",)]
    started, done = threading.Event(), threading.Event()
    errors = []

    def run_bulk():
        try:
            with start_bulk() as events:
                for _ in events:
                    started.set()
                    if done.is_set():
                        break
        except Exception as e:  # noqa: BLE001  # reported on the test's thread
            errors.append(e)
            started.set()

    bulk = threading.Thread(target=run_bulk)
    bulk.start()
    try:
        assert started.wait(60) and not errors, errors
        urgent()
    finally:
        done.set()
        bulk.join(120)
    return tenant_metrics(server)[("num_preemptions_total",)] > before


def test_a_tenants_priority_class_preempts_a_lower_class(tenant_server):
    def bulk():
        return oai(tenant_server, "bulk").chat.completions.create(
            model=model_of(tenant_server.url), messages=[{"role": "user", "content": COUNT}], max_tokens=200,
            temperature=0, stream=True, extra_body={"priority": -5})  # a request cannot run before its tenant's class

    def urgent():
        claude(tenant_server, "urgent").messages.create(
            model=model_of(tenant_server.url), max_tokens=2, messages=[{"role": "user", "content": "hi"}])

    assert _preempts(tenant_server, bulk, urgent)


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_responses_and_messages_take_a_priority(tenant_server, route):
    """A request of the "open" tenant (class 0) asks to run after others (priority 10) on
    /v1/responses or /v1/messages; a default-priority chat request of the same tenant preempts it."""
    if route == "responses":
        def bulk():
            return oai(tenant_server, "open").responses.create(
                model=model_of(tenant_server.url), input=COUNT, max_output_tokens=200, temperature=0, stream=True,
                extra_body={"priority": 10})
    else:
        def bulk():
            return claude(tenant_server, "open").messages.create(
                model=model_of(tenant_server.url), max_tokens=200, stream=True,
                messages=[{"role": "user", "content": COUNT}], extra_body={"priority": 10, "temperature": 0})

    def urgent():
        oai(tenant_server, "open").chat.completions.create(
            model=model_of(tenant_server.url), messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    assert _preempts(tenant_server, bulk, urgent)


def test_prefix_cache_blocks_are_shared_within_a_tenant_only(tenant_server):
    prompt = [100 + (i * 37) % 5000 for i in range(200)]

    def hits_after(tenant: str) -> float:
        oai(tenant_server, tenant).completions.create(model=model_of(tenant_server.url), prompt=prompt, max_tokens=1)
        return tenant_metrics(tenant_server)[("prefix_cache_hits_total",)]

    first = hits_after("open")
    again = hits_after("open")
    assert again - first >= 160  # the same tenant: all full blocks of the prompt
    assert hits_after("other") == again  # another tenant: nothing
    assert hits_after("other") - again >= 160  # ...but its own blocks, the second time


def test_keys_hash_prints_the_sha256_of_each_key_on_stdin():
    out = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "keys", "hash"],
                         input="sk-one\n\nsk-two\n", capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [hashlib.sha256(k).hexdigest() for k in (b"sk-one", b"sk-two")]


def test_a_bad_keys_file_stops_the_server_before_it_loads(tmp_path):
    bad = tmp_path / "keys.yaml"
    bad.write_text("tenants: {a: {rpm: -1}}\nkeys: [{tenant: a, key: k}]")
    out = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--api-keys", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--api-keys" in out.stderr and "tenants.a.rpm must be an integer >= 1" in out.stderr


def _status(server, key: str) -> int:
    return httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {key}"}).status_code


def test_sighup_reloads_the_file_and_a_bad_file_keeps_the_keys(tenant_server, keys_path):
    """Last: it retires the "open" tenant's key."""
    keys_path.write_text(keys_yaml({**KEYS, "open": NEW_KEY}))
    tenant_server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while _status(tenant_server, KEYS["open"]) != 401 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _status(tenant_server, KEYS["open"]) == 401
    assert _status(tenant_server, NEW_KEY) == 200
    keys_path.write_text("tenants: [")
    tenant_server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "not reloading the keys" not in tenant_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "not reloading the keys" in tenant_server.log()
    assert _status(tenant_server, NEW_KEY) == 200 and tenant_server.proc.poll() is None
    assert not any(key in tenant_server.log() for key in (*KEYS.values(), NEW_KEY))
