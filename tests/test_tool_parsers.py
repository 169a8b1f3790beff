"""The Hermes tool-call parser: whole replies and the same replies streamed in pieces."""
from __future__ import annotations

import json

import pytest

from pagedserve.http.tool_parsers import TOOL_PARSERS

HERMES = TOOL_PARSERS["hermes"]
TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "where": {"lat": 48}}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {"x": 2}, "name": "g"}\n</tool_call>\n'
)


def _streamed(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` in `step`-character pieces; the content and (name, arguments) joined back."""
    parser = HERMES.stream()
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    calls: list[list[str]] = []
    for piece in (p for d in deltas for p in d.tool_calls):
        if piece.id is not None:
            assert piece.index == len(calls) and piece.id.startswith("call_")
            calls.append([piece.name, piece.arguments])
        else:
            calls[piece.index][1] += piece.arguments
    return "".join(d.content for d in deltas), [(name, args) for name, args in calls]


def test_whole_reply_with_content_and_two_calls():
    content, calls = HERMES.parse(TWO_CALLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "where": {"lat": 48}}), ("g", {"x": 2})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, 1000])
def test_streamed_pieces_join_to_the_whole_parse(step):
    content, calls = HERMES.parse(TWO_CALLS)
    assert _streamed(TWO_CALLS, step) == (content, [(c.name, c.arguments) for c in calls])


@pytest.mark.parametrize("text", ["plain answer", "a < b and <tool", "<tool_call>\nnot json\n</tool_call>",
                                  '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'])
def test_text_without_a_valid_call_is_content(text):
    assert HERMES.parse(text) == (text, [])


def test_plain_text_streams_unchanged_including_a_held_back_tag_prefix():
    assert _streamed("a < b and <tool", 1) == ("a < b and <tool", [])


def test_unclosed_call_at_the_end_is_closed():
    content, calls = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"a": "}"}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": "}"}')]
