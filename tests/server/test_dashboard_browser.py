"""/dashboard in a real browser: Playwright driving Debian's Chromium against real
servers. The page streams a chat reply, block cells change state under a batch and
return to free, a shared-prefix pair marks shared blocks, and with an API key the
page works only for a client that sends it. Screenshots land in the test's log dir.

Chromium is never downloaded: .ci/run installs Debian's package, and a missing
/usr/bin/chromium fails these tests rather than skipping them.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from .server_process import ServerProcess, start_server
from .test_server_spec_decode import counter

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
API_KEY = "dashboard-test-key"
TIMEOUT_MS = 60_000
expect.set_options(timeout=TIMEOUT_MS)
COLOUR_SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                 "required": ["colour"], "additionalProperties": False}
SHARED_PREFIX = "You are a meticulous assistant who answers questions about the history of paged memory. " * 3

# Records, in the page, what the block map showed at any frame: a state seen only
# between two polls from Python is still caught.
WATCH_MAP = """() => {
  window.seen = {u: 0, s: 0, w: 0, lit: 0, running: 0, updates: 0};
  const note = () => {
    const cells = document.querySelectorAll('#block-map .cell');
    const count = (code) => [...cells].filter((c) => c.dataset.state === code).length;
    for (const code of ['u', 's', 'w']) window.seen[code] = Math.max(window.seen[code], count(code));
    window.seen.lit = Math.max(window.seen.lit, document.querySelectorAll('#block-map .cell.lit').length);
    window.seen.running = Math.max(window.seen.running, document.querySelectorAll('#q-running li').length);
  };
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, attributes: true});
  const transcript = document.getElementById('transcript');
  new MutationObserver(() => window.seen.updates++).observe(transcript, {subtree: true, characterData: true, childList: true});
}"""
IDLE_MAP = """() => {
  const cells = [...document.querySelectorAll('#block-map .cell')];
  return cells.length > 0 && cells.every((c) => c.dataset.state === 'f' || c.dataset.state === 'c')
    && document.getElementById('count-used').textContent === '0';
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1500, "height": 950})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


@pytest.fixture(scope="module")
def screenshots(server_logs: Path) -> Path:
    path = server_logs / "dashboard-screenshots"
    path.mkdir(exist_ok=True)
    return path


def open_dashboard(page: Page, server: ServerProcess) -> None:
    response = page.goto(server.url + "/dashboard")
    assert response is not None and response.status == 200
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    expect(page.locator("#block-map .cell").first).to_be_visible()
    page.wait_for_function(IDLE_MAP)
    page.evaluate(WATCH_MAP)


def test_chat_streams_lights_its_blocks_and_follows_a_schema(page, server, screenshots):
    open_dashboard(page, server)
    page.fill("#system", "You are a storyteller.")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "64")
    page.fill("#message", "Tell a long story about a dragon who learns to count.")
    page.click("#send")
    choice = page.locator("#transcript .choice").first
    expect(choice).to_have_attribute("data-done", "true")
    assert len(choice.text_content()) > 20
    seen = page.evaluate("window.seen")
    assert seen["updates"] > 3, seen  # the reply arrived in pieces, not at once
    assert seen["lit"] > 0, seen  # the playground request's blocks were highlighted
    # A second turn: two samples held to a JSON schema.
    page.fill("#n", "2")
    page.fill("#schema", json.dumps(COLOUR_SCHEMA))
    page.fill("#message", "Pick a colour.")
    page.click("#send")
    replies = page.locator("#transcript .msg.assistant").nth(1).locator(".choice")
    expect(replies).to_have_count(2)
    for i in range(2):
        expect(replies.nth(i)).to_have_attribute("data-done", "true")
        assert json.loads(replies.nth(i).text_content())["colour"] in ("red", "green", "blue")
    page.wait_for_function(IDLE_MAP)
    page.screenshot(path=screenshots / "chat.png", full_page=True)


def test_batch_fills_blocks_and_returns_them(page, server, screenshots):
    open_dashboard(page, server)
    bodies = [{"prompt": f"Request {i}: count from one to fifty.", "max_tokens": 40, "ignore_eos": True}
              for i in range(8)]
    with httpx.Client(base_url=server.url, timeout=120) as http, ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=body) for body in bodies]
        page.wait_for_function("window.seen.running >= 2")
        page.screenshot(path=screenshots / "batch.png", full_page=True)
        page.hover("#block-map .cell[data-state='u']")
        expect(page.locator("#tooltip")).to_contain_text("request cmpl-")
        expect(page.locator("#tooltip")).to_contain_text("tokens in")
        assert all(f.result().status_code == 200 for f in futures)
    page.wait_for_function(IDLE_MAP)
    seen = page.evaluate("window.seen")
    assert seen["u"] >= len(bodies), seen
    assert page.locator("#steps .bar").count() > 0
    assert page.locator("#steps .bar .decode").count() > 0


def test_shared_prefix_pair_marks_shared_blocks(page, server, screenshots):
    open_dashboard(page, server)
    bodies = [{"prompt": SHARED_PREFIX + tail, "max_tokens": 32, "ignore_eos": True} for tail in ("Why?", "How?")]
    with httpx.Client(base_url=server.url, timeout=120) as http, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=body) for body in bodies]
        page.wait_for_function("window.seen.s > 0")
        assert all(f.result().status_code == 200 for f in futures)
    page.hover("#block-map .cell[data-state='c']")
    expect(page.locator("#tooltip")).to_contain_text("cached")
    page.wait_for_function(IDLE_MAP)
    page.screenshot(path=screenshots / "shared.png", full_page=True)


def test_playground_pauses_and_resumes_speculation(page, spec_server, server):
    assert httpx.post(server.url + "/dashboard/speculation", json={"enabled": False}).status_code == 404
    open_dashboard(page, spec_server)
    expect(page.locator("#spec-mode")).to_contain_text("ngram, 3 tokens, on")
    body = {"prompt": "red green blue red green blue red green blue red", "max_tokens": 12, "temperature": 0}

    def drafted_after_a_request() -> tuple[float, str]:
        before = counter(httpx.get(spec_server.url + "/metrics").text, "spec_decode_num_draft_tokens")
        reply = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        return counter(httpx.get(spec_server.url + "/metrics").text, "spec_decode_num_draft_tokens") - before, reply

    page.uncheck("#speculate")
    expect(page.locator("#spec-mode")).to_contain_text("paused")
    paused, paused_reply = drafted_after_a_request()
    page.check("#speculate")
    expect(page.locator("#spec-mode")).to_contain_text("on")
    drafted, reply = drafted_after_a_request()
    assert paused == 0 < drafted
    assert reply == paused_reply  # speculation changes the pace, never the greedy output


@pytest.fixture(scope="module")
def key_server(server_logs) -> Iterator[ServerProcess]:
    proc = start_server(server_logs, "--api-key", API_KEY)
    yield proc
    proc.stop()


def test_api_key_guards_the_page(browser, key_server):
    refused = browser.new_context()
    try:
        response = refused.new_page().goto(key_server.url + "/dashboard")
        assert response is not None and response.status == 401
    finally:
        refused.close()
    for path in ("/dashboard/events", "/dashboard/static/app.js"):
        assert httpx.get(key_server.url + path, timeout=10).status_code == 401
    keyed = browser.new_context(extra_http_headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        page = keyed.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        open_dashboard(page, key_server)
        page.fill("#max_tokens", "8")
        page.fill("#message", "Hello!")
        page.click("#send")
        expect(page.locator("#transcript .choice").first).to_have_attribute("data-done", "true")
        expect(page.locator("#chat-status")).to_have_text("done")
    finally:
        keyed.close()
