"""Per-sequence incremental detokenization with stop strings.

Each step decodes only a short window of ids: the tokens since the last emitted
boundary (`read`) plus the ones before it back to the previous boundary, so the
decoder sees the context it needs (a SentencePiece decoder drops a leading space
at the start of a decode) and the cost per step does not grow with the output.
Text ending in U+FFFD is a UTF-8 sequence still missing bytes: it waits for the
next token. Text that could be the start of a stop string waits too, so a stop
string never leaks into a streamed delta.
"""
from __future__ import annotations

from collections.abc import Sequence

from pagedserve.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token; a handful is
# enough for any decoder's look-behind (leading-space rules, byte pieces).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turn one sequence's output ids into text deltas.

    `update(ids)` returns `(delta_text, matched_stop)`; once a stop string
    matches, the output ends just before it (or after it, with
    `include_stop_str_in_output`) and no further update is accepted. Call
    `finish()` when the sequence ends for another reason to flush held text.
    The concatenation of all deltas is `output_text`; for a context-free decoder
    (byte-level BPE) it equals `tokenizer.decode(output_ids, skip_special_tokens)`
    cut at the stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        if isinstance(stop, str) or (stop is not None and not all(isinstance(s, str) and s for s in stop)):
            raise ValueError("stop must be a list of non-empty strings")
        self._backend = tokenizer.backend
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop or ())
        self._include_stop = include_stop_str_in_output
        self._longest_stop = max(map(len, self._stop), default=0)
        # A held-back tail must end in a character some stop has before its last one.
        self._stop_inner_chars = frozenset(c for s in self._stop for c in s[:-1])

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character; its missing bytes belong to the
            # output's own text, as in a decode of the output ids alone.
            context, context_text = [], ""
        self._window = context  # ids from the previous boundary onward
        self._read = len(context)  # window[:read] is already turned into text
        self._read_text = context_text  # decode(window[:read])
        self._held = ""  # decoded text not yet emitted: may begin a stop string
        self._text = ""
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    @property
    def finished(self) -> bool:
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Append this step's ids; return the text now safe to stream and the stop hit, if any."""
        if self._finished:
            raise RuntimeError("update() called after the detokenizer finished")
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._read_text) or text.endswith(_REPLACEMENT):
            return "", None
        new_text = text[len(self._read_text):]
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return self._release(self._held + new_text, final=False)

    def finish(self) -> str:
        """End without a stop token: emit everything held back (a stop may still match)."""
        if self._finished:
            return ""
        text = self._decode(self._window)
        delta, _ = self._release(self._held + text[len(self._read_text):], final=True)
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _release(self, pending: str, *, final: bool) -> tuple[str, str | None]:
        """Emit `pending` up to a stop match, or up to any tail that could still become one."""
        hit = self._first_stop(pending)
        if hit is not None:
            index, stop = hit
            delta = pending[: index + len(stop) if self._include_stop else index]
            self._held, self._matched_stop, self._finished = "", stop, True
        else:
            keep = 0 if final else self._stop_prefix_length(pending)
            delta, self._held = pending[: len(pending) - keep], pending[len(pending) - keep:]
        self._text += delta
        return delta, self._matched_stop

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # Earliest start wins; among stops starting at the same place, the first listed.
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = text.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._stop_inner_chars:
            return 0
        start = max(0, len(text) - self._longest_stop + 1)
        for i in range(start, len(text)):
            suffix = text[i:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return len(text) - i
        return 0
