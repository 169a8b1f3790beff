"""Units of the server's request parsing that need no server: the prompt-length bound
and the lone-surrogate check."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.protocol import max_prompt_chars
from pagedserve.http.errors import APIError
from pagedserve.http.json_body import parse_body
from pagedserve.http.openai_bodies import CompletionRequest
from pagedserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(gguf_file) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_file)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(text=st.text(min_size=1, max_size=400) | st.from_regex(r"[ \n\t]{1,300}x?", fullmatch=True))
def test_no_text_is_longer_than_the_bound_for_its_tokens(tokenizer, text):
    """max_prompt_chars never refuses a prompt that would fit: any text is at most its
    token count times the longest vocabulary spelling. Except for characters the
    tokenizer drops (hypothesis found "\x16": SmolLM2 has no token for some control
    bytes), which the bound counts though they take no room: text made almost only of
    those can be refused though it fits (see docs/reliability.md)."""
    assume(all(tokenizer.encode(char, add_special_tokens=False) for char in set(text)))
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    vocabulary = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert len(text) <= max_prompt_chars(vocabulary, num_tokens)


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"prompt": "ok", "stop": ["\\udfff"]}', "stop"),
    (b'{"prompt": "ok", "\\ud800": 1}', None),  # a name that is not Unicode cannot be sent back
])
def test_lone_surrogates_are_a_400_naming_the_field(raw, param):
    with pytest.raises(APIError) as e:
        parse_body(raw, CompletionRequest)
    assert e.value.status == 400 and e.value.param == param


def test_surrogate_pairs_and_integral_floats_parse():
    req = parse_body(b'{"prompt": "\\ud83d\\ude00", "max_tokens": 3.0, "temperature": 1.0}', CompletionRequest)
    assert req.prompt == "\U0001F600" and req.max_tokens == 3 and req.temperature == 1.0
    with pytest.raises(APIError):
        parse_body(b'{"prompt": "x", "max_tokens": 3.5}', CompletionRequest)
