"""One reply's text split into reasoning, answer and tool calls, whole or as it
streams: the reasoning parser first, then the tool-call parser on the answer alone."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .reasoning_parsers import PromptReasoning, split
from .tool_parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass(slots=True)
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ReplyParser:
    """Fed one choice's deltas; `reasoning` None: no reasoning split, `tools` None: no calls."""

    def __init__(self, reasoning: PromptReasoning | None, tools: ToolParser | None):
        self._reasoning = reasoning.stream() if reasoning is not None else None
        self._tools = tools.stream() if tools is not None else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    def feed(self, text: str, num_tokens: int, last: bool) -> ReplyDelta:
        """What the next delta (`text`, `num_tokens` tokens) lets go; `last`: the reply ends with it."""
        out = ReplyDelta(content=text)
        if self._reasoning is not None:
            split_delta = self._reasoning.feed(text, num_tokens, last=last)
            out.reasoning, out.content = split_delta.reasoning, split_delta.content
        if self._tools is not None:
            parsed = self._tools.feed(out.content, last=last)
            out.content, out.tool_calls = parsed.content, parsed.tool_calls
        return out


@dataclass(slots=True)
class Reply:
    reasoning: str | None
    content: str | None  # None: no answer text (only calls, or reasoning cut off by max_tokens)
    calls: list[ToolCall]
    reasoning_tokens: int


def parse_reply(pieces: Sequence[tuple[str, int]], reasoning: PromptReasoning | None,
                tools: ToolParser | None) -> Reply:
    """A whole reply, as its deltas' (text, tokens): calls are read from the answer only."""
    if reasoning is not None:
        thought, content, num_tokens = split(reasoning.stream(), pieces)
    else:
        thought, content, num_tokens = None, "".join(text for text, _ in pieces), 0
    calls: list[ToolCall] = []
    if tools is not None:
        parsed, calls = tools.parse(content)
        content = parsed or ""
    empty = calls or reasoning is not None
    return Reply(thought, content if content or not empty else None, calls, num_tokens)
