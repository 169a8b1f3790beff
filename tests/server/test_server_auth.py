"""With an API key, everything but /health needs it, however the path is spelled and whatever the Host."""
from __future__ import annotations

from http.client import HTTPConnection

import anthropic
import httpx
import openai
import pytest

from .server_process import start_server

KEY = "sk-test-3f9a1c77e2"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def keyed_server(server_logs):
    # The key comes from the environment, so the flag never shows up in the process list.
    proc = start_server(server_logs, "--allowed-origins", ORIGIN, env={"PAGEDSERVE_API_KEY": KEY})
    yield proc
    proc.stop()


def raw_request(port: int, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> int:
    """Send `path` byte for byte (HTTP clients normalise '.', '//' and case in URLs)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body,
                     headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


COMPLETION = b'{"prompt": "hi", "max_tokens": 1}'
PROTECTED = [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("POST", "/tokenize"), ("POST", "/detokenize"),
    # Spellings a path check could miss.
    ("POST", "//v1/completions"), ("POST", "/V1/completions"), ("POST", "/v1/./completions"),
    ("POST", "/v1//completions"), ("POST", "/v1/../v1/completions"), ("POST", "/v1/completions/"),
    ("POST", "/%761/completions"), ("POST", "/v1/completions?x=/health"), ("GET", "/V1/MODELS"),
    ("POST", "/health/../v1/completions"), ("GET", "/docs"), ("GET", "/no/such/route"),
    ("POST", "/v1%2Fcompletions"), ("POST", "/v1%2fcompletions/"), ("POST", "/tokenize/"), ("POST", "//tokenize"),
    ("GET", "/metrics"), ("GET", "/metrics/"), ("GET", "//metrics"), ("GET", "/version"), ("GET", "/openapi.json"),
    ("GET", "/health/../metrics"), ("GET", "/health%2F..%2Fmetrics"), ("GET", "/v1/kv_events"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Bearer {KEY}x", KEY, f"Basic {KEY}"],
                         ids=["no-header", "wrong-key", "key-prefix", "no-scheme", "basic-scheme"])
def test_protected_paths_need_the_key(keyed_server, method, path, auth):
    headers = {"authorization": auth} if auth is not None else {}
    assert raw_request(keyed_server.port, method, path, headers, COMPLETION if method == "POST" else None) == 401


def test_the_key_opens_the_api(keyed_server):
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    assert r.choices[0].text is not None
    bearer = {"authorization": f"Bearer {KEY}"}
    assert raw_request(keyed_server.port, "POST", "/tokenize", bearer, b'{"prompt": "hi"}') == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_anthropic_clients_send_the_key_as_x_api_key(keyed_server):
    model = httpx.get(keyed_server.url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]
    # The client also sends anthropic-version, which the server accepts.
    claude = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEY, max_retries=0)
    hi = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert claude.messages.create(**hi).usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=keyed_server.url, api_key=KEY + "x", max_retries=0).messages.create(**hi)
    assert info.value.body["error"]["type"] == "authentication_error"
    # The header opens the OpenAI routes as well; their 401 keeps OpenAI's shape.
    assert raw_request(keyed_server.port, "POST", "/tokenize", {"x-api-key": KEY}, b'{"prompt": "hi"}') == 200
    r = httpx.post(keyed_server.url + "/tokenize", headers={"x-api-key": "wrong"}, json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_only_health_needs_no_key(keyed_server):
    assert raw_request(keyed_server.port, "GET", "/health") == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "evil.example", "", "127.0.0.1:1/health"])
def test_the_host_header_does_not_matter(keyed_server, host):
    assert raw_request(keyed_server.port, "GET", "/metrics", {"host": host}) in (400, 401)
    assert raw_request(keyed_server.port, "GET", "/metrics", {"host": host, "authorization": f"Bearer {KEY}"}) \
        in (200, 400)


def test_metrics_and_openapi_open_with_the_key(keyed_server):
    bearer = {"authorization": f"Bearer {KEY}"}
    for path in ("/metrics", "/version", "/openapi.json", "/docs"):
        assert raw_request(keyed_server.port, "GET", path, bearer) == 200, path


def test_keys_are_compared_as_equal_length_digests(monkeypatch):
    """Constant time whatever the length: compare_digest only ever sees two 32-byte digests."""
    from pagedserve.http import middleware

    seen: list[tuple[int, int]] = []
    real = middleware.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    check = middleware.APIKeyMiddleware(app=None, api_key=KEY)
    for token in (b"", b"x", KEY.encode(), KEY.encode() * 50):
        authorized = check._authorized({"headers": [(b"authorization", b"Bearer " + token)]})
        assert authorized == (token == KEY.encode())
    assert seen == [(32, 32)] * 4


def test_the_key_never_reaches_the_log(keyed_server):
    raw_request(keyed_server.port, "POST", "/v1/completions", {"authorization": f"Bearer {KEY}"}, COMPLETION)
    raw_request(keyed_server.port, "POST", "/v1/completions", {"authorization": "Bearer wrong"}, COMPLETION)
    log = keyed_server.log()
    assert '"api_key": "<set>"' in log  # the effective configuration says a key is set...
    assert KEY not in log  # ...but never what it is


def test_cors_only_for_allowed_origins(keyed_server, http):
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    r = httpx.options(keyed_server.url + "/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(keyed_server.url + "/v1/completions", headers={**preflight, "origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    # The shared server was started without --allowed-origins: CORS is off.
    r = http.get("/v1/models", headers={"origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
