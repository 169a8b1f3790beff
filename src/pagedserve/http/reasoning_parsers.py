"""Reasoning formats: how a thinking model marks its reasoning, and the parser that
splits its text (whole or streamed) into reasoning and answer, as vLLM's
`--reasoning-parser` chooses (docs/reasoning.md).

- "deepseek_r1" (DeepSeek-R1 and its distills, QwQ): `<think>…</think>`; the template
  usually opens `<think>` in the prompt, so the output starts inside the reasoning and
  only `</think>` appears. Output that never closes the section is all reasoning.
- "qwen3" (Qwen3, Phi-4-reasoning): the same markers, but the model opens `<think>`
  itself; output that does not start with it is all answer. A prompt whose template
  already closed the section (`enable_thinking: false`) is not parsed at all.
- "gpt_oss" (harmony): channels, not markers: `analysis` is reasoning, `final` the
  answer, `commentary` (preambles, tool calls) the answer too. Its markers are special
  tokens, so it reads text decoded with them (the model is not loadable yet; the parser
  is tested on text).

Markers are found in text, so a marker the model writes as several tokens, split
across streamed deltas, is held back until it is whole.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..sampling_params import ReasoningMarkers
from .tool_parsers import partial_suffix

Encode = Callable[[str], Sequence[int]]


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class StreamingReasoningParser(ABC):
    """Splits one reply, as it arrives, into reasoning and content; counts the tokens
    of the deltas that belong to the reasoning section."""

    def __init__(self) -> None:
        self.reasoning_tokens = 0
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
    `commentary` are the answer; text between messages (`<|start|>assistant`) is dropped.
    The markers are special tokens: the text must keep them (skip_special_tokens false)."""

    # The header may carry a recipient and a content type (`to=functions.f <|constrain|>json`).
    _HEADER = re.compile(r"<\|channel\|>([A-Za-z_]+).*?<\|message\|>", re.DOTALL)
    _ENDS = ("<|end|>", "<|return|>", "<|call|>")
    _OPEN = "<|start|>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._channel: str | None = None  # the open message's channel

    def _take(self, text: str, out: ReasoningDelta, last: bool) -> bool:
        self._held += text
        reasoning = self._channel == "analysis"
        while True:
            if self._channel is None:
                if not self._header(last):
                    break
                reasoning = reasoning or self._channel == "analysis"
            elif not self._body(out, last):
                break
        return reasoning

    def _header(self, last: bool) -> bool:
        """Open the next message once its header is whole; False to wait for more text."""
        match = self._HEADER.search(self._held)
        if match is None:
            if last:
                self._held = ""  # a header cut off by max_tokens says nothing
            return False
        self._channel = match.group(1)
        self._held = self._held[match.end():]
        return True

    def _body(self, out: ReasoningDelta, last: bool) -> bool:
        """Let go of the open message's text; True when it closed (look for the next one)."""
        ends = [(i, marker) for marker in self._ENDS if (i := self._held.find(marker)) >= 0]
        if ends:
            end, marker = min(ends)
            self._send(out, self._held[:end])
            self._held = self._held[end + len(marker):].removeprefix(self._OPEN).removeprefix("assistant")
            self._channel = None
            return True
        keep = 0 if last else max(partial_suffix(self._held, marker) for marker in self._ENDS)
        self._send(out, self._held[:len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]
        return False

    def _send(self, out: ReasoningDelta, text: str) -> None:
        if self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text


@dataclass(frozen=True, slots=True)
class PromptReasoning:
    """A reasoning format as one request's prompt left it: whether the output starts
    inside the reasoning, or whether it may open the section itself."""

    format: ReasoningFormat
    starts_in_reasoning: bool

    def stream(self) -> StreamingReasoningParser:
        return self.format.parser(self.starts_in_reasoning)

    def markers(self, encode: Encode) -> ReasoningMarkers:
        return self.format.markers(encode, self.starts_in_reasoning)


@dataclass(frozen=True)
class ReasoningFormat(ABC):
    name: str

    @abstractmethod
    def for_prompt(self, prompt: str) -> PromptReasoning | None:
        """How this request's output is split; None when the prompt turned thinking off."""

    @abstractmethod
    def parser(self, starts_in_reasoning: bool) -> StreamingReasoningParser:
        """A parser for one reply."""

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

    def parser(self, starts_in_reasoning: bool) -> StreamingReasoningParser:
        # A model may open the section again though its prompt did (R1 distills do): dropped.
        return ThinkTagParser(self.start, self.end, _Section.REASONING if starts_in_reasoning else _Section.CONTENT)

    def markers(self, encode: Encode, starts_in_reasoning: bool) -> ReasoningMarkers:
        start = () if starts_in_reasoning else tuple(encode(self.start))
        return ReasoningMarkers(tuple(encode(self.end + self.after_end)), starts_in_reasoning, start)


@dataclass(frozen=True)
class HarmonyFormat(ReasoningFormat):
    def for_prompt(self, prompt: str) -> PromptReasoning | None:
        return PromptReasoning(self, False)

    def parser(self, starts_in_reasoning: bool) -> StreamingReasoningParser:
        return HarmonyParser()

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
