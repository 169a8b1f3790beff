"""Beam search on /v1/completions through the official client (vLLM's use_beam_search extension)."""
from __future__ import annotations

import openai
import pytest

PROMPT = "The capital of France is"


def test_beam_search_returns_the_best_n_beams_in_order(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2,
                                  extra_body={"use_beam_search": True, "beam_width": 3, "length_penalty": 1.0,
                                              "early_stopping": False})
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.text for c in r.choices]
    assert all(texts) and texts[0] != texts[1]
    assert 2 <= r.usage.completion_tokens <= 2 * 6  # the returned beams' tokens
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    # The same request twice gives the same beams (no sampling anywhere).
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2,
                                      extra_body={"use_beam_search": True, "beam_width": 3})
    assert [c.text for c in again.choices] == texts


def test_beam_width_defaults_to_n_and_width_one_is_greedy(client, model):
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    beam = client.completions.create(model=model, prompt=PROMPT, max_tokens=5,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True, "beam_width": 0}, "beam_width"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": True, "beam_width": 2, "n": 3}, "n"),
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "guided_regex": "[a-z]+"}, "structured_outputs"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 2}, "beam_width"),
    ({"length_penalty": 2.0}, "length_penalty"),
])
def test_bad_beam_search_requests_are_400s(http, model, body, param):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param != "early_stopping":  # a body-shape error names the field in its message
        assert error["param"] == param, error


def test_beam_search_bad_input_with_the_client_raises(client, model):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=1.0,
                                  extra_body={"use_beam_search": True})
