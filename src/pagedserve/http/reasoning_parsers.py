"""Reasoning formats: how a thinking model marks its reasoning, and the parser that
splits its text (whole or streamed) into reasoning and answer, as vLLM's
`--reasoning-parser` chooses (docs/reasoning.md).

- "deepseek_r1" (DeepSeek-R1 and its distills, QwQ): `<think>…</think>`; the template
  usually opens `<think>` in the prompt, so the output starts inside the reasoning and
  only `</think>` appears. Output that never closes the section is all reasoning.
- "qwen3" (Qwen3, Phi-4-reasoning): the same markers, but the model opens `<think>`
  itself; output that does not start with it is all answer. A prompt whose template
  already closed the section (`enable_thinking: false`) is not parsed at all.
- "gpt_oss" (harmony, docs/harmony.md): channels, not markers: `analysis` is reasoning,
  `final` the answer, `commentary` preambles the answer too, and a message addressed
  `to=functions.NAME` a tool call. Its markers are special tokens, so it reads text
  decoded with them.

Markers are found in text, so a marker the model writes as several tokens, split
across streamed deltas, is held back until it is whole.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from ..sampling_params import ReasoningMarkers
from .tool_parsers import ToolCallDelta, new_call_id, partial_suffix

Encode = Callable[[str], Sequence[int]]


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # formats that write calls their own way


class StreamingReasoningParser(ABC):
    """Splits one reply, as it arrives, into reasoning and content; counts the tokens
    of the deltas that belong to the reasoning section."""

    def __init__(self) -> None:
        self.reasoning_tokens = 0
        self.num_calls = 0  # tool calls read (formats that write calls their own way)
        self._undecided_tokens = 0  # tokens whose section is not known yet

    def feed(self, text: str, num_tokens: int = 0, *, last: bool = False) -> ReasoningDelta:
        """What `text` (`num_tokens` tokens) lets go; with `last`, everything held too."""
        out = ReasoningDelta()
        self._undecided_tokens += num_tokens
        verdict = self._take(text, out, last)
        if verdict is not None:
            self.reasoning_tokens += self._undecided_tokens if verdict else 0
            self._undecided_tokens = 0
        return out

    @abstractmethod
    def _take(self, text: str, out: ReasoningDelta, last: bool) -> bool | None:
        """Append what can be let go to `out`; whether `text` belongs to the reasoning
        (the delta that closes the section does), None while that is not known yet."""


def split(parser: StreamingReasoningParser, pieces: Sequence[tuple[str, int]]) -> tuple[str | None, str, int]:
    """A whole reply, as (text, tokens) pieces: (reasoning or None, content, reasoning tokens)."""
    reasoning, content = [], []
    for i, (text, num_tokens) in enumerate(pieces):
        delta = parser.feed(text, num_tokens, last=i == len(pieces) - 1)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    if not pieces:
        delta = parser.feed("", last=True)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    return "".join(reasoning) or None, "".join(content), parser.reasoning_tokens


class _Section(Enum):
    UNDECIDED = "undecided"  # nothing but whitespace (or a partial start marker) seen yet
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkTagParser(StreamingReasoningParser):
    """`<think>` reasoning `</think>` answer. The reasoning and the answer come without
    the whitespace around them (templates put newlines after each marker)."""

    def __init__(self, start: str, end: str, undecided: _Section):
        super().__init__()
        self._start, self._end = start, end
        self._section = _Section.UNDECIDED
        self._undecided = undecided  # what output that does not open the section is
        self._held = ""  # text not let go yet
        self._space = ""  # reasoning's trailing whitespace, let go only if more reasoning follows
        self._reasoning_started = False
        self._content_started = False

    def _take(self, text: str, out: ReasoningDelta, last: bool) -> bool | None:
        self._held += text
        if self._section is _Section.UNDECIDED:
            self._decide(last)
            if self._section is _Section.UNDECIDED:
                return None
        reasoning = self._section is _Section.REASONING
        if reasoning:
            self._reason(out, last)
        if self._section is _Section.CONTENT:
            self._answer(out)
        return reasoning

    def _decide(self, last: bool) -> None:
        head = self._held.lstrip()
        if head.startswith(self._start):
            self._held = head[len(self._start):]
            self._section = _Section.REASONING
        elif last or not self._start.startswith(head):
            self._section = self._undecided

    def _reason(self, out: ReasoningDelta, last: bool) -> None:
        end = self._held.find(self._end)
        if end >= 0:
            self._emit_reasoning(out, self._held[:end].rstrip())
            self._held = self._held[end + len(self._end):]
            self._section = _Section.CONTENT
            return
        keep = 0 if last else partial_suffix(self._held, self._end)
        piece = self._held[:len(self._held) - keep]
        self._held = self._held[len(piece):]
        stripped = piece.rstrip()
        self._emit_reasoning(out, stripped)
        self._space += piece[len(stripped):]

    def _emit_reasoning(self, out: ReasoningDelta, piece: str) -> None:
        if not self._reasoning_started:
            piece = piece.lstrip()
            self._space = ""
        if piece:
            out.reasoning += self._space + piece
            self._space = ""
            self._reasoning_started = True

    def _answer(self, out: ReasoningDelta) -> None:
        piece, self._held = self._held, ""
        if not self._content_started:
            piece = piece.lstrip()
        if piece:
            out.content += piece
            self._content_started = True


class HarmonyParser(StreamingReasoningParser):
    """gpt-oss's harmony text: `<|channel|>NAME<|message|>text<|end|>` messages (the first
    one's `<|start|>assistant` is in the prompt). `analysis` is reasoning; `final` and
    `commentary` are the answer, and so is a channel harmony does not define (kept, not
    refused: the text is the model's). A message addressed `to=functions.NAME` is a tool
    call when `read_calls` (its body, the arguments, as written), else its body is answer
    text. Text between messages (`<|start|>assistant`) is dropped. The markers are special
    tokens: the text must keep them (skip_special_tokens false)."""

    _MESSAGE = "<|message|>"
    _CHANNEL = re.compile(r"<\|channel\|>([A-Za-z_]+)")
    # The recipient comes after the role or after the channel (`to=functions.f <|constrain|>json`).
    _RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.-]+)")
    _ENDS = ("<|end|>", "<|return|>", "<|call|>")

    def __init__(self, read_calls: bool = False) -> None:
        super().__init__()
        self._read_calls = read_calls
        self._held = ""
        self._channel: str | None = None  # the open message's channel
        self._call: str | None = None  # the open message's call id, when it is a tool call

    def _take(self, text: str, out: ReasoningDelta, last: bool) -> bool | None:
        self._held += text
        reasoning = self._channel == "analysis"
        in_message = self._channel is not None  # else a header's tokens belong to the message they open
        while True:
            if self._channel is None:
                if not self._header(out, last):
                    break
                in_message = True
                reasoning = reasoning or self._channel == "analysis"
            elif not self._body(out, last):
                break
        return reasoning if in_message else None

    def _header(self, out: ReasoningDelta, last: bool) -> bool:
        """Open the next message once its header is whole; False to wait for more text."""
        end = self._held.find(self._MESSAGE)
        if end < 0:
            if last:
                self._held = ""  # a header cut off by max_tokens says nothing
            return False
        header, self._held = self._held[:end], self._held[end + len(self._MESSAGE):]
        channel = self._CHANNEL.search(header)
        self._channel = channel.group(1) if channel is not None else ""
        recipient = self._RECIPIENT.search(header)
        if self._read_calls and recipient is not None:
            self._call = new_call_id()
            out.tool_calls.append(ToolCallDelta(self.num_calls, "", self._call, recipient.group(1)))
        return True

    def _body(self, out: ReasoningDelta, last: bool) -> bool:
        """Let go of the open message's text; True when it closed (look for the next one).
        A call cut off by the end of the reply (`<|call|>` is a stop token) closes too."""
        ends = [(i, marker) for marker in self._ENDS if (i := self._held.find(marker)) >= 0]
        if ends:
            end, marker = min(ends)
            self._send(out, self._held[:end])
            self._held = self._held[end + len(marker):]
            self._close()
            return True
        keep = 0 if last else max(partial_suffix(self._held, marker) for marker in self._ENDS)
        self._send(out, self._held[:len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]
        if last:
            self._close()
        return False

    def _close(self) -> None:
        if self._call is not None:
            self.num_calls += 1
        self._channel, self._call = None, None

    def _send(self, out: ReasoningDelta, text: str) -> None:
        if not text:
            return
        if self._call is not None:
            if out.tool_calls and out.tool_calls[-1].index == self.num_calls:
                out.tool_calls[-1].arguments += text  # one piece per call per delta
            else:
                out.tool_calls.append(ToolCallDelta(self.num_calls, text))
        elif self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text


@dataclass(frozen=True, slots=True)
class PromptReasoning:
    """A reasoning format as one request's prompt left it: whether the output starts
    inside the reasoning, or whether it may open the section itself."""

    format: ReasoningFormat
    starts_in_reasoning: bool

    def stream(self, read_calls: bool = False) -> StreamingReasoningParser:
        return self.format.parser(self.starts_in_reasoning, read_calls)

    def markers(self, encode: Encode) -> ReasoningMarkers:
        return self.format.markers(encode, self.starts_in_reasoning)


@dataclass(frozen=True)
class ReasoningFormat(ABC):
    name: str
    # The format writes tool calls its own way (harmony's commentary channel): its parser
    # reads them, and no tool-call parser is run on the answer.
    reads_calls: ClassVar[bool] = False
    # Its markers are special tokens: replies are decoded with them (skip_special_tokens false).
    special_markers: ClassVar[bool] = False

    @abstractmethod
    def for_prompt(self, prompt: str) -> PromptReasoning | None:
        """How this request's output is split; None when the prompt turned thinking off."""

    @abstractmethod
    def parser(self, starts_in_reasoning: bool, read_calls: bool = False) -> StreamingReasoningParser:
        """A parser for one reply; `read_calls`: calls come out as calls (`reads_calls` formats)."""

    @abstractmethod
    def markers(self, encode: Encode, starts_in_reasoning: bool) -> ReasoningMarkers:
        """The section's markers in token ids, for the engine's thinking budget."""

    def parse(self, prompt: str, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply to `prompt`, None for an empty part."""
        setup = self.for_prompt(prompt)
        if setup is None:
            return None, text or None
        reasoning, content, _ = split(setup.stream(), [(text, 0)])
        return reasoning, content or None


@dataclass(frozen=True)
class ThinkTagFormat(ReasoningFormat):
    """`<think>…</think>`; `reasoning_first`: output that does not open the section is
    reasoning (R1, whose template opens it) rather than the answer (Qwen3)."""

    reasoning_first: bool = True
    start: str = "<think>"
    end: str = "</think>"
    # What templates write after the closing marker; the engine writes it too when it closes the section.
    after_end: str = "\n\n"

    def for_prompt(self, prompt: str) -> PromptReasoning | None:
        start, end = prompt.rfind(self.start), prompt.rfind(self.end)
        if start > end:
            return PromptReasoning(self, True)
        if end >= 0 and not prompt[end + len(self.end):].strip():
            return None  # the template closed an empty section: thinking is off
        return PromptReasoning(self, self.reasoning_first)

    def parser(self, starts_in_reasoning: bool, read_calls: bool = False) -> StreamingReasoningParser:
        # A model may open the section again though its prompt did (R1 distills do): dropped.
        return ThinkTagParser(self.start, self.end, _Section.REASONING if starts_in_reasoning else _Section.CONTENT)

    def markers(self, encode: Encode, starts_in_reasoning: bool) -> ReasoningMarkers:
        start = () if starts_in_reasoning else tuple(encode(self.start))
        return ReasoningMarkers(tuple(encode(self.end + self.after_end)), starts_in_reasoning, start)


@dataclass(frozen=True)
class HarmonyFormat(ReasoningFormat):
    reads_calls: ClassVar[bool] = True
    special_markers: ClassVar[bool] = True

    def for_prompt(self, prompt: str) -> PromptReasoning | None:
        return PromptReasoning(self, False)

    def parser(self, starts_in_reasoning: bool, read_calls: bool = False) -> StreamingReasoningParser:
        return HarmonyParser(read_calls)

    def markers(self, encode: Encode, starts_in_reasoning: bool) -> ReasoningMarkers:
        return ReasoningMarkers(tuple(encode("<|end|><|start|>assistant<|channel|>final<|message|>")), False,
                                tuple(encode("<|channel|>analysis<|message|>")))


REASONING_PARSERS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ThinkTagFormat("deepseek_r1", reasoning_first=True),
    ThinkTagFormat("qwen3", reasoning_first=False),
    HarmonyFormat("gpt_oss"),
)}


def detect_reasoning_parser(chat_template: str | None) -> ReasoningFormat | None:
    """The format a chat template writes: harmony channels -> gpt_oss; `<think>` with an
    `enable_thinking` switch -> qwen3, without -> deepseek_r1; else None (no parsing)."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return REASONING_PARSERS["gpt_oss"]
    if "<think>" in chat_template or "</think>" in chat_template:
        return REASONING_PARSERS["qwen3" if "enable_thinking" in chat_template else "deepseek_r1"]
    return None
