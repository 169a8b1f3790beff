"""Tool-call formats: how a model writes a call, the grammar that forces one, and the
parser that reads calls back out of its text (whole or streamed), as vLLM's
`--tool-call-parser` chooses.

One format for now, "hermes" (Hermes 2 Pro, Qwen2.5, SmolLM2's ChatML): each call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. Forced calls
(`tool_choice` "required" or a named function) are generated under a grammar of that
same text, so one parser reads forced and free calls alike.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

# The JSON inside a forced call is written with the usual separators and no free
# whitespace: a small model given the choice pads with blank lines (see llguidance_backend).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call `index`: the first piece carries id and name, later ones only arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """A tool-call format; subclasses set the tags, template and header pattern."""

    name: str
    template_file: str  # a ChatML template that renders tools, for models whose own does not

    def chat_template(self) -> str:
        return resources.files(__package__).joinpath("templates", self.template_file).read_text(encoding="utf-8")

    @abstractmethod
    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose sentences are one call (or, when `parallel`, several)
        of one of `functions`, arguments valid against its parameters schema."""

    @abstractmethod
    def stream(self) -> StreamingToolParser:
        """A parser fed one reply's text piece by piece."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; all of it as content when a call does not parse."""
        parser = self.stream()
        parsed = [parser.feed(text), parser.finish()]
        calls = join_calls(c for d in parsed for c in d.tool_calls)
        content = "".join(d.content for d in parsed)
        if not calls:
            return text, []
        if not all(call.name and is_json_object(call.arguments) for call in calls):
            return text, []
        return content or None, calls


def join_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """A reply's call pieces, in order, joined into its calls."""
    calls: list[ToolCall] = []
    for delta in deltas:
        if delta.id is not None:
            calls.append(ToolCall(delta.id, delta.name or "", delta.arguments))
        else:
            calls[delta.index].arguments += delta.arguments
    return calls


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class StreamingToolParser:
    """Splits a reply, as it arrives, into content and call pieces.

    Content is held back while it could be the start of an opening tag, and trailing
    whitespace is held until more content follows (whitespace between calls is not
    content). Arguments stream as the model writes them, minus any trailing run of
    `}` and whitespace, which may be the call's own closing brace; the rest comes when
    the call closes, so the pieces join to exactly the arguments' JSON text.
    """

    def __init__(self, open_tag: str, close_tag: str, header: re.Pattern[str]):
        self._open, self._close, self._header = open_tag, close_tag, header
        self._text = ""
        self._pos = 0  # everything before this is emitted (or dropped)
        self._pending_space = ""
        self._num_calls = 0
        self._in_call = False
        self._body_start = 0  # where the open call's JSON starts
        self._args_start: int | None = None  # where its arguments start, once the header is seen
        self._args_sent = 0  # characters of arguments emitted

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        """What the next text lets go; with `last` (the reply ends with it), `finish`'s rest too."""
        self._text += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        if last:
            rest = self.finish()
            out.content += rest.content
            out.tool_calls += rest.tool_calls
        return out

    def finish(self) -> ParsedDelta:
        """The rest at the end of the reply: an unclosed call is closed; held content is let go."""
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self._in_call:
            self._close_call(out, len(self._text))
        else:
            rest = self._text[self._pos:]
            if self._num_calls == 0 or rest.strip():
                out.content += self._pending_space + rest
        self._pos = len(self._text)
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Emit what can be emitted; True when a tag boundary was crossed (step again)."""
        if not self._in_call:
            start = self._text.find(self._open, self._pos)
            if start >= 0:
                self._emit_content(out, self._text[self._pos:start], dropping_space=True)
                self._in_call, self._args_start, self._args_sent = True, None, 0
                self._body_start = self._pos = start + len(self._open)
                return True
            if not final:
                end = max(self._pos, len(self._text) - partial_suffix(self._text, self._open))
                self._emit_content(out, self._text[self._pos:end], dropping_space=False)
                self._pos = end
            return False
        end = self._text.find(self._close, self._body_start)
        if end >= 0:
            self._close_call(out, end)
            self._pos = end + len(self._close)
            return True
        if self._args_start is None:
            match = self._header.match(self._text, self._body_start)
            if match is None:
                return False
            self._args_start = match.end()
            out.tool_calls.append(ToolCallDelta(self._num_calls, "", new_call_id(), match.group(1)))
        if not final:
            # A partial closing tag, and the trailing } and whitespace (maybe the call's own
            # closing brace) are held back.
            region = self._text[self._args_start:len(self._text) - partial_suffix(self._text, self._close)]
            self._send_args(out, re.sub(r"[\s}]*$", "", region))
        return False

    def _emit_content(self, out: ParsedDelta, text: str, dropping_space: bool) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            out.content += self._pending_space + stripped
            self._pending_space = ""
        self._pending_space += text[len(stripped):]
        if dropping_space:
            self._pending_space = ""

    def _close_call(self, out: ParsedDelta, end: int) -> None:
        """The call's body is text[_body_start:end]: send what is left of it."""
        body = self._text[self._body_start:end]
        if self._args_start is None:
            # No `{"name": ..., "arguments": ...` header (another key order, or not JSON):
            # take the whole body if it is a call, else the raw body as arguments.
            name, arguments = _call_from_json(body)
            out.tool_calls.append(ToolCallDelta(self._num_calls, arguments, new_call_id(), name))
        else:
            region = self._text[self._args_start:end]
            try:
                _, length = json.JSONDecoder().raw_decode(region)
                arguments = region[:length]
            except ValueError:
                arguments = re.sub(r"\s*}?\s*$", "", region, count=1)
            self._send_args(out, arguments)
        self._num_calls += 1
        self._in_call = False

    def _send_args(self, out: ParsedDelta, arguments: str) -> None:
        piece = arguments[self._args_sent:]
        if not piece:
            return
        self._args_sent = len(arguments)
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == self._num_calls:
            last.arguments += piece  # one piece per call per chunk
        else:
            out.tool_calls.append(ToolCallDelta(self._num_calls, piece))


def _call_from_json(body: str) -> tuple[str, str]:
    try:
        value = json.loads(body)
    except ValueError:
        return "", body.strip()
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)
    return "", body.strip()


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (it may become the marker):
    what a streaming parser holds back until the next delta decides."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    template_file = "tool_chat_template_hermes.jinja"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')

    def stream(self) -> StreamingToolParser:
        return StreamingToolParser(self._OPEN, self._CLOSE, self._HEADER)

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        calls = [{
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        } for f in functions]
        schema = {"x-guidance": _JSON_STYLE, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([
            start,
            f'call: {json.dumps(self._OPEN + chr(10))} body {json.dumps(chr(10) + self._CLOSE)}',
            f"body: %json {json.dumps(schema, ensure_ascii=False)}",
        ])


TOOL_PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in (HermesToolParser(),)}
