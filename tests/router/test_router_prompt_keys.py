"""The cache_aware router's prompt keys on bodies the replica will refuse: none (the
request goes by load and the replica answers its 400), never an error in the router.
(test_kv_event_stream.py checks the keys of valid prompts against the engine's hashes.)"""
from __future__ import annotations

import json

import pytest

from pagedserve.model.sources import load_model_tokenizer
from pagedserve.router.prompt_keys import NO_KEYS, PromptKeyer

BLOCK = 16


@pytest.fixture(scope="module")
def keyer() -> PromptKeyer:
    return PromptKeyer(load_model_tokenizer(None))


@pytest.mark.parametrize("bad_id", [2**63, 2**64 + 5, -1, -(2**63) - 1, 49_152],
                         ids=["int64-max+1", "beyond-uint64", "negative", "below-int64", "vocab-size"])
def test_token_ids_outside_the_vocabulary_get_no_keys(keyer, bad_id):
    # make fuzz found it: an id past int64 raised struct.error while the router hashed the
    # prompt's blocks, and the router answered 500.
    prompt = [1] * (3 * BLOCK) + [bad_id]
    keys = keyer.keys("/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert keys is NO_KEYS and keys.hashes(BLOCK) == []


def test_a_valid_token_id_prompt_keeps_its_keys(keyer):
    prompt = list(range(1, 3 * BLOCK + 2))
    keys = keyer.keys("/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert keys.token_ids == prompt and len(keys.hashes(BLOCK)) == 3


def _chat_keys(keyer: PromptKeyer, path: str = "/v1/chat/completions", **fields) -> list[int]:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return keyer.keys(path, json.dumps(body).encode()).token_ids


def test_chat_template_kwargs_are_part_of_the_key():
    """enable_thinking changes what the template renders: two requests that differ only
    there are different prompts, and a reserved variable is the replica's 400 (no keys)."""
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                "{% if reasoning_effort is defined %}{{ reasoning_effort }}{% endif %}")
    keyer = PromptKeyer(load_model_tokenizer(None).with_chat_template(template))
    plain = _chat_keys(keyer)
    off = _chat_keys(keyer, chat_template_kwargs={"enable_thinking": False})
    assert off != plain and keyer.tokenizer.decode(off) == "Hi<think></think>"
    assert keyer.tokenizer.decode(_chat_keys(keyer, reasoning_effort="low")) == "Hilow"
    assert _chat_keys(keyer, chat_template_kwargs={"messages": []}) == []
