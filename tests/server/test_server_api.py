"""The OpenAI API over HTTP, through the official client and raw requests."""
from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


def sse_events(http, path: str, body: dict) -> list[dict]:
    """POST with stream=true; the decoded `data:` events, checking the stream ends with [DONE]."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completion_non_stream(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == model and r.created > 0
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 6)
    assert r.usage.total_tokens == 11


def test_completion_default_max_tokens_is_16(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_chat_non_stream(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5


def test_chat_max_completion_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_streamed_text_equals_non_streamed_for_the_same_seed(client, model):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"

    chat_kwargs = dict(model=model, messages=CHAT, max_tokens=12, temperature=1.0, seed=99)
    full = client.chat.completions.create(**chat_kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**chat_kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


def test_seed_reproducible_and_seeds_differ(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_usage_in_last_stream_chunk(client, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.prompt_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])

    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 4


def test_n3_gives_three_distinct_choices(client, http, model):
    prompt = "My favourite animal is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=3,
                                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    # The prompt is counted once, however many samples share it.
    assert r.usage.prompt_tokens == http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert r.usage.completion_tokens == 24

    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=3, temperature=1.0,
                                                 seed=5, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_several_prompts_give_one_choice_block_each(client, model):
    r = client.completions.create(model=model, prompt=["Hello", "The sky is", "Once"], max_tokens=3, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples agree
    assert r.usage.completion_tokens == 18
    alone = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert by_index[2] == alone.choices[0].text  # prompt 1's block is choices 2 and 3

    token_lists = client.completions.create(model=model, prompt=[[504, 3458], [1, 2, 3]], max_tokens=2,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in token_lists.choices) == [0, 1]
    assert token_lists.usage.prompt_tokens == 5


def test_token_id_prompt_equals_text_prompt(client, http, model):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    a = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    b = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert a == b


def test_echo_prepends_the_prompt(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_stop_string_cuts_the_text(client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = base[3:6]
    assert stop.strip()
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    c = r.choices[0]
    assert c.text == base[: base.index(stop)] and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                              stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_and_logit_bias(client, http, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logprobs=0).choices[0]
    first = http.post("/tokenize", json={"prompt": base.text, "add_special_tokens": False}).json()["tokens"][0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"stop_token_ids": [first]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == first
    banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != base.logprobs.tokens[0]


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) >= 3
        assert value == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_and_top_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes) == entry.token.encode()
    streamed = [c for c in client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                                          logprobs=True, stream=True) if c.choices]
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_raw_sse_framing_and_finish_chunk(http, model):
    events = sse_events(http, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 3,
                                                   "ignore_eos": True})
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_unknown_fields_ignored_and_vllm_extras_accepted(http, model):
    r = http.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 2, "totally_unknown": {"x": [1, 2]}, "user": "u1",
        "priority": 3, "cache_salt": "tenant-a", "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 1,
    })
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_models_version_tokenize_detokenize(http, model):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model
    assert models["data"][0]["max_model_len"] == 1024
    assert http.get("/version").json()["version"]
    tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) == 5 and tok["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert chat["count"] > bare["count"] > 5 and chat["tokens"][: bare["count"]] == bare["tokens"]


def test_health_and_metrics(http, client, model):
    assert http.get("/health").status_code == 200
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert families["pagedserve:" + name].type == "histogram"
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert families["pagedserve:" + name].type == "gauge"
    for name in ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
                 "prefix_cache_hits", "request_success"):
        assert families["pagedserve:" + name].type == "counter"
    samples = {(s.name, s.labels.get("finished_reason")): s.value for f in families.values() for s in f.samples}
    assert samples[("pagedserve:request_success_total", "length")] >= 1
    assert samples[("pagedserve:generation_tokens_total", None)] >= 2
