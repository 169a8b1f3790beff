"""/v1/embeddings with the official openai client, /v1/score and /v1/rerank through httpx,
on a real server over a tiny random checkpoint transformers wrote: the vectors equal
transformers' pooled final hidden states, embeddings ride beside generation in the same
batches with the same bits, and bad input is a 400 in OpenAI's shape."""
from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from pagedserve.model.loader import load_model
from pooling_reference import reference_embedding, save_tiny_llama

from .server_process import start_server

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Cats purr when happy."]
# The server's fp32 native kernels against transformers' fp32 products: summation orders differ.
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(gguf_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-embed-server")
    tokenizer = load_model(gguf_path).tokenizer
    return path, save_tiny_llama(path, tokenizer), tokenizer


@pytest.fixture(scope="module")
def tiny_server(tiny, server_logs):
    proc = start_server(server_logs, "--model", str(tiny[0]), "--max-model-len", "128")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_embeddings_match_transformers(tiny, oai):
    _, ref, tokenizer = tiny
    model = oai.models.list().data[0].id
    result = oai.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert [d.index for d in result.data] == [0, 1, 2] and result.object == "list"
    for prompt, data in zip(ids, result.data):
        torch.testing.assert_close(torch.tensor(data.embedding), reference_embedding(ref, prompt), rtol=0, atol=ATOL)
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    # The client's default asks for base64 and decodes it: the same float32 bits.
    decoded = oai.embeddings.create(model=model, input=TEXTS)
    assert [d.embedding for d in decoded.data] == [d.embedding for d in result.data]
    # Token ids embed as their text does.
    by_ids = oai.embeddings.create(model=model, input=ids[1], encoding_format="float")
    assert by_ids.data[0].embedding == result.data[1].embedding
    short = oai.embeddings.create(model=model, input=TEXTS[0], dimensions=8, encoding_format="float")
    vector = np.array(short.data[0].embedding)
    assert len(vector) == 8 and abs(np.linalg.norm(vector) - 1) < 1e-6
    np.testing.assert_allclose(vector, np.array(result.data[0].embedding[:8]) /
                               np.linalg.norm(result.data[0].embedding[:8]), atol=1e-6)


def test_base64_is_little_endian_float32(tiny_server):
    body = {"input": TEXTS[0]}
    floats = httpx.post(tiny_server.url + "/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    r = httpx.post(tiny_server.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60)
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert raw.tolist() == floats


def test_embeddings_beside_generation_keep_their_bits(tiny_server, oai):
    model = oai.models.list().data[0].id
    alone = [d.embedding for d in oai.embeddings.create(model=model, input=TEXTS, encoding_format="float").data]
    done = []

    def generate() -> None:
        out = oai.completions.create(model=model, prompt=TEXTS[0] * 3, max_tokens=48, temperature=0,
                                     extra_body={"ignore_eos": True})
        done.append(out.usage.completion_tokens)

    threads = [threading.Thread(target=generate) for _ in range(3)]
    for t in threads:
        t.start()
    busy = [[d.embedding for d in oai.embeddings.create(model=model, input=TEXTS, encoding_format="float").data]
            for _ in range(3)]
    for t in threads:
        t.join()
    assert done == [48, 48, 48]
    assert all(b == alone for b in busy)


def test_score_and_rerank_are_the_cosine_of_embeddings(tiny_server):
    url = tiny_server.url
    vectors = [np.array(d["embedding"]) for d in httpx.post(url + "/v1/embeddings", json={"input": TEXTS},
                                                            timeout=60).json()["data"]]
    cosine = [float(vectors[0] @ v) for v in vectors]
    score = httpx.post(url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2] and score["object"] == "list"
    assert [d["score"] for d in score["data"]] == pytest.approx(cosine, abs=1e-6)
    assert score["usage"]["prompt_tokens"] > 0
    pairwise = httpx.post(url + "/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}, timeout=60).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])], abs=1e-6)
    rerank = httpx.post(url + "/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:] + [TEXTS[0]],
                                                  "top_n": 2}, timeout=60).json()
    documents_scores = cosine[1:] + [cosine[0]]
    best = sorted(range(3), key=lambda i: -documents_scores[i])[:2]
    assert [r["index"] for r in rerank["results"]] == best == [2, best[1]]
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([documents_scores[i] for i in best],
                                                                               abs=1e-6)
    assert rerank["results"][0]["document"] == {"text": TEXTS[0]}
    bare = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": ["a", "b"], "return_documents": False},
                      timeout=60).json()
    assert len(bare["results"]) == 2 and all("document" not in r for r in bare["results"])


@pytest.mark.parametrize("body, param, code", [
    ({"input": ""}, "input", None),
    ({"input": []}, "input", None),
    ({"input": [[]]}, "input", None),
    ({"input": "hi", "dimensions": 65}, "dimensions", None),
    ({"input": "hi", "dimensions": 0}, "dimensions", None),
    ({"input": [5] * 129}, "input", "context_length_exceeded"),
    ({"input": [10 ** 9]}, "input", None),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
])
def test_bad_embedding_input_is_a_400(tiny_server, body, param, code):
    r = httpx.post(tiny_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_the_openai_client_raises_on_a_400_and_score_pairs_must_match(oai, tiny_server):
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=oai.models.list().data[0].id, input="hi", dimensions=1000)
    r = httpx.post(tiny_server.url + "/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
    r = httpx.post(tiny_server.url + "/v1/rerank", json={"query": "q", "documents": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_a_generate_only_server_refuses_embeddings(tiny, server_logs):
    """(An embed-only engine refusing generation is tests/test_pooling.py's; the server turns that
    ValueError into a 400 as it does any other.)"""
    proc = start_server(server_logs, "--model", str(tiny[0]), "--task", "generate")
    try:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["a"]}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"})):
            r = httpx.post(proc.url + path, json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task", (path, r.text)
            assert "task 'generate'" in r.json()["error"]["message"]
        assert httpx.post(proc.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        assert proc.stop() == 0
