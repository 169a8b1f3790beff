"""One reply's text split into reasoning, answer and tool calls, whole or as it
streams: the reasoning parser first, then the tool-call parser on the answer alone; a
reasoning format that writes calls its own way (harmony) reads them itself."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .reasoning_parsers import PromptReasoning
from .tool_parsers import ToolCall, ToolCallDelta, ToolParser, is_json_object, join_calls


@dataclass(slots=True)
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ReplyParser:
    """Fed one choice's deltas; `reasoning` None: no reasoning split, `tools` None: no calls."""

    def __init__(self, reasoning: PromptReasoning | None, tools: ToolParser | None):
        own_calls = reasoning is not None and reasoning.format.reads_calls
        self._reasoning = reasoning.stream(read_calls=tools is not None) if reasoning is not None else None
        self._tools = tools.stream() if tools is not None and not own_calls else None

    @property
    def num_calls(self) -> int:
        own = self._reasoning.num_calls if self._reasoning is not None else 0
        return own + (self._tools.num_calls if self._tools is not None else 0)

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    def feed(self, text: str, num_tokens: int, last: bool) -> ReplyDelta:
        """What the next delta (`text`, `num_tokens` tokens) lets go; `last`: the reply ends with it."""
        out = ReplyDelta(content=text)
        if self._reasoning is not None:
            split_delta = self._reasoning.feed(text, num_tokens, last=last)
            out.reasoning, out.content, out.tool_calls = split_delta.reasoning, split_delta.content, \
                split_delta.tool_calls
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
    own_calls = reasoning is not None and reasoning.format.reads_calls
    parser = ReplyParser(reasoning, tools if own_calls else None)
    last = len(pieces) - 1
    deltas = [parser.feed(text, n, i == last) for i, (text, n) in enumerate(pieces)] or [parser.feed("", 0, True)]
    thought = "".join(d.reasoning for d in deltas) or None
    content = "".join(d.content for d in deltas)
    calls = join_calls(call for d in deltas for call in d.tool_calls)
    if any(not is_json_object(call.arguments) for call in calls):
        # A call cut off by max_tokens (or not JSON): its text is content, as a tool parser's
        # calls that do not parse are, so every call returned has an object's arguments.
        content += "".join(call.arguments for call in calls if not is_json_object(call.arguments))
        calls = [call for call in calls if is_json_object(call.arguments)]
    if tools is not None and not own_calls:
        parsed, calls = tools.parse(content)  # whole, so a reply whose calls do not parse stays content
        content = parsed or ""
    empty = calls or reasoning is not None
    return Reply(thought, content if content or not empty else None, calls, parser.reasoning_tokens)
