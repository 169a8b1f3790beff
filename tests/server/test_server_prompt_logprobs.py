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
