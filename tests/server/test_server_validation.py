"""Every bad request fails alone with a 4xx in OpenAI's error shape and leaves the engine serving."""
from __future__ import annotations

import re

import pytest

CONTEXT = 1024  # the shared server's --max-model-len
VOCAB = 49152  # SmolLM2's vocabulary
LONG_PROMPT = [1] * 1100
NEAR_FULL_PROMPT = [1] * 1000
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return COMPLETIONS, {"prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields):
    return CHAT, {"messages": MESSAGES, "max_tokens": 2, **fields}


# (id, path, JSON body or raw bytes, status, param the error must name or None)
JSON_CASES = [
    ("prompt-over-context", *completion(prompt=LONG_PROMPT), 400, "prompt"),
    ("prompt-plus-max-tokens-over-context", *completion(prompt=NEAR_FULL_PROMPT, max_tokens=100), 400, "max_tokens"),
    ("chat-prompt-plus-max-tokens-over-context", *chat(max_tokens=5000), 400, "max_tokens"),
    ("empty-prompt", *completion(prompt=""), 400, "prompt"),
    ("empty-token-prompt", *completion(prompt=[]), 400, "prompt"),
    ("empty-prompt-in-list", *completion(prompt=["a", ""]), 400, "prompt"),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-wrong-type", *completion(prompt={"text": "x"}), 400, "prompt"),
    ("max-tokens-zero", *completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", *completion(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", *completion(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-float", *completion(max_tokens=2.5), 400, "max_tokens"),
    ("chat-max-completion-tokens-zero", *chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature-negative", *completion(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", *completion(top_p=0), 400, "top_p"),
    ("top-p-over-one", *completion(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", *completion(top_k=-2), 400, "top_k"),
    ("min-p-negative", *completion(min_p=-0.1), 400, "min_p"),
    ("min-p-over-one", *completion(min_p=1.5), 400, "min_p"),
    ("n-zero", *completion(n=0), 400, "n"),
    ("n-over-max-n", *completion(n=17), 400, "n"),
    ("chat-n-over-max-n", *chat(n=17), 400, "n"),
    ("logprobs-over-max", *completion(logprobs=21), 400, "logprobs"),
    ("chat-top-logprobs-over-max", *chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", *chat(top_logprobs=2), 400, "top_logprobs"),
    ("presence-penalty-over", *completion(presence_penalty=3), 400, "presence_penalty"),
    ("repetition-penalty-zero", *completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("prompt-token-over-vocab", *completion(prompt=[1, VOCAB]), 400, "prompt"),
    ("prompt-token-negative", *completion(prompt=[-1, 5]), 400, "prompt"),
    ("prompt-token-bool", *completion(prompt=[True, 5]), 400, "prompt"),
    ("logit-bias-token-over-vocab", *completion(logit_bias={str(VOCAB + 5): 1.0}), 400, "logit_bias"),
    ("logit-bias-not-a-token", *completion(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    ("stop-token-over-vocab", *completion(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("seventeen-stop-strings", *completion(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("empty-stop-string", *completion(stop=["ok", ""]), 400, "stop"),
    ("empty-stop-string-alone", *completion(stop=""), 400, "stop"),
    ("chat-template-in-body", *chat(chat_template="{{ messages }}"), 400, "chat_template"),
    ("chat-messages-missing", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("chat-messages-empty", *chat(messages=[]), 400, "messages"),
    ("chat-message-without-role", *chat(messages=[{"content": "x"}]), 400, "messages"),
    ("chat-image-part", *chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages"),
    ("chat-tool-not-a-function", *chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    ("stream-not-bool", *completion(stream="yes"), 400, "stream"),
    ("unknown-model", *completion(model="gpt-4"), 404, "model"),
    ("chat-unknown-model", *chat(model="gpt-4"), 404, "model"),
    ("body-is-a-list", COMPLETIONS, [1, 2], 400, None),
    ("body-is-a-string", CHAT, "hello", 400, None),
    ("detokenize-over-vocab", "/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
    ("tokenize-neither", "/tokenize", {"add_special_tokens": True}, 400, "prompt"),
    # Found by hand and by schemathesis: each was a 500.
    ("chat-empty-role-null-content", CHAT, {"messages": [{"role": "", "content": None}]}, 400, "messages"),
    ("tokenize-empty-role-null-content", "/tokenize", {"messages": [{"role": "", "content": None}]}, 400,
     "messages"),
    ("chat-null-content-the-template-cannot-render", *chat(messages=[{"role": "user", "content": None}]), 400,
     "messages"),
    ("chat-min-tokens-beyond-the-room-left", CHAT, {"messages": MESSAGES, "min_tokens": 5000}, 400, "min_tokens"),
]

RAW_CASES = [
    ("invalid-json", COMPLETIONS, b'{"prompt": "x", ', 400),
    ("not-utf8", COMPLETIONS, b"\xff\xfe\x00", 400),
    ("empty-body", CHAT, b"", 400),
    ("temperature-nan", COMPLETIONS, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', 400),
    ("temperature-infinity", COMPLETIONS, b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}', 400),
    ("temperature-overflow", COMPLETIONS, b'{"prompt": "x", "max_tokens": 2, "temperature": 1e999}', 400),
    ("top-p-nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 400),
    ("deeply-nested", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    # A lone surrogate is valid JSON but not Unicode text (the tokenizer raised: a 500).
    ("lone-surrogate-prompt", COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 2}', 400),
    ("lone-surrogate-tokenize", "/tokenize", b'{"prompt": "a\\udfff"}', 400),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}', 400),
    ("lone-surrogate-stop", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\udc00"]}', 400),
]

def assert_openai_error(r, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"] and not re.search(r"0x[0-9a-f]{6,}", error["message"])
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_bad_json_request(http, path, body, status, param):
    assert_openai_error(http.post(path, json=body), status, param)


@pytest.mark.parametrize(("path", "raw", "status"), [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_bad_raw_body(http, path, raw, status):
    assert_openai_error(http.post(path, content=raw, headers={"content-type": "application/json"}), status)


def test_lone_surrogate_names_its_field_and_a_pair_is_fine(http):
    raw = b'{"prompt": "\\ud800", "max_tokens": 2}'
    r = http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "prompt")
    assert "surrogate" in r.json()["error"]["message"]
    paired = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'  # one emoji, written as a UTF-16 pair
    assert http.post(COMPLETIONS, content=paired, headers={"content-type": "application/json"}).status_code == 200


def test_integral_floats_count_as_integers(http):
    """JSON Schema calls 2.0 an integer, so the published schema allows it; 2.5 stays a 400."""
    r = http.post(COMPLETIONS, content=b'{"prompt": [1.0, 2.0], "max_tokens": 2.0, "ignore_eos": true}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                          "total_tokens": 4}


def test_context_errors_carry_both_numbers(http):
    r = http.post(COMPLETIONS, json={"prompt": LONG_PROMPT, "max_tokens": 2})
    assert "1100" in r.json()["error"]["message"] and str(CONTEXT) in r.json()["error"]["message"]
    r = http.post(COMPLETIONS, json={"prompt": NEAR_FULL_PROMPT, "max_tokens": 100})
    message = r.json()["error"]["message"]
    assert all(str(number) in message for number in (1000, 100, CONTEXT))


def test_body_over_limit_is_413(http):
    body = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    assert_openai_error(http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}), 413)


def test_unknown_route_and_wrong_method_use_the_error_shape(http):
    assert_openai_error(http.post("/v1/nothing-here", json={}), 404)
    assert_openai_error(http.get(COMPLETIONS), 405)


def test_default_chat_max_tokens_fills_the_context(http):
    """Without max_tokens a chat may run to the context length, so a near-full prompt still fits."""
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi " * 980}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT


# Odd values for every field, one at a time: none may produce a 5xx.
FUZZ_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs", "stop",
               "stop_token_ids", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "ignore_eos", "echo", "stream_options", "priority", "cache_salt", "min_tokens", "model",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]
FUZZ_VALUES = [None, -1, 2**70, -1e308, "", "x", [], [None], {"a": None}, True]


@pytest.mark.parametrize("field", FUZZ_FIELDS)
def test_no_5xx_for_odd_values(http, field):
    for value in FUZZ_VALUES:
        r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, field: value})
        assert r.status_code < 500, (field, value, r.text)
        if r.status_code >= 400:
            assert_openai_error(r, r.status_code)


def test_the_engine_still_serves_after_all_that(http):
    assert http.get("/health").status_code == 200
    r = http.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

