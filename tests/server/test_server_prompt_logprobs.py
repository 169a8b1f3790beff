"""/v1/completions with echo and logprobs: the prompt's tokens scored, as lm-eval's
local-completions model asks (max_tokens 0 or 1)."""
from __future__ import annotations

import math

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def test_echo_scores_the_prompt_with_max_tokens_zero(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and len(lp.tokens) == r.usage.prompt_tokens
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the top 2, and the token itself
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # " Paris" after "The capital of France is" is the model's first choice.
    paris = lp.tokens.index(" Paris")
    assert lp.token_logprobs[paris] == max(lp.top_logprobs[paris].values())


def test_echo_with_one_token_and_streaming_agree(client, model):
    fields = dict(model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    whole = client.completions.create(**fields).choices[0]
    scored = client.completions.create(**{**fields, "max_tokens": 0}).choices[0].logprobs
    n = len(scored.tokens)
    assert whole.logprobs.tokens[:n] == scored.tokens and len(whole.logprobs.tokens) == n + 1
    assert all(a == b or abs(a - b) < 1e-4 for a, b in zip(whole.logprobs.token_logprobs[1:n],
                                                           scored.token_logprobs[1:]))
    tokens, values, text = [], [], ""
    for chunk in client.completions.create(**fields, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs


CHAT = [{"role": "user", "content": "The capital of France is Paris. What is the capital of Italy?"}]


def test_chat_prompt_logprobs_score_the_rendered_prompt(http, model):
    """vLLM's chat extension: per prompt token, {token id: logprob, rank, decoded_token},
    the same values /v1/completions gives for the rendered prompt's tokens."""
    r = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 1, "temperature": 0,
                                                "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    entries = body["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] == len(ids) and entries[0] is None
    echoed = http.post("/v1/completions", json={"model": model, "prompt": ids, "echo": True, "logprobs": 2,
                                                "max_tokens": 0}).json()["choices"][0]["logprobs"]
    for i in range(1, len(ids)):
        chosen = entries[i][str(ids[i])]
        assert 2 <= len(entries[i]) <= 3 and {lp["rank"] for lp in entries[i].values()} >= {1, 2}
        assert chosen["decoded_token"] == echoed["tokens"][i]
        assert abs(chosen["logprob"] - echoed["token_logprobs"][i]) < 1e-4
    plain = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


def test_chat_prompt_logprobs_bad_requests_are_400(http, model):
    for fields, message in [({"stream": True}, "not supported with stream"), ({"prompt_logprobs": 21}, "less than or equal to 20"),
                            ({"prompt_logprobs": -1}, "greater than or equal to 0")]:
        r = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 1,
                                                    "prompt_logprobs": 1, **fields})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt_logprobs" and message in error["message"], error
