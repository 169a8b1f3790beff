"""Where one sample stands in its thinking section, derived from its output tokens alone.

A reasoning model writes `<think> ... </think>` before its answer. The state walks the
output through three phases: OPENING (waiting for the start marker; skipped when the
prompt already opened the section), REASONING (every token counts, until the end
marker) and ANSWER. It tells the sampler which token, if any, the next position must
take: the rest of the end marker once `budget` reasoning tokens have been written (and,
for a structured-output request, the start marker, so that its answer always comes
after a section the grammar waits out).

Everything is a function of the output tokens: `sync` replays whatever it has not seen,
so preemption, recompute, prefix-cache hits and parallel-sampling forks (which keep or
copy the output) leave it exact, and a state that sees fewer tokens than before starts
over. Markers are matched with their partial prefixes kept (a marker split over steps or
over accepted speculative tokens is still found).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


class ReasoningPhase(enum.IntEnum):
    OPENING = 0
    REASONING = 1
    ANSWER = 2


def _extend_match(marker: tuple[int, ...], matched: int, token: int) -> int:
    """The longest prefix of `marker` that ends the text marker[:matched] + [token]."""
    text = (*marker[:matched], token)
    for length in range(min(matched + 1, len(marker)), 0, -1):
        if text[len(text) - length:] == marker[:length]:
            return length
    return 0


@dataclass(slots=True)
class ReasoningState:
    end_token_ids: tuple[int, ...]
    start_token_ids: tuple[int, ...]
    starts_in_reasoning: bool
    # Reasoning tokens after which the engine writes the end marker itself (None: no limit).
    budget: int | None
    # A structured-output request opens its section by force: its answer must come after one.
    force_start: bool = False
    phase: ReasoningPhase = field(init=False)
    # Tokens written in REASONING so far, a partly written end marker included.
    count: int = field(init=False, default=0)
    # How much of the marker the current phase waits for ends the output so far.
    matched: int = field(init=False, default=0)
    num_seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.end_token_ids = tuple(self.end_token_ids)
        self.start_token_ids = tuple(self.start_token_ids)
        self.phase = ReasoningPhase.REASONING if self.starts_in_reasoning else ReasoningPhase.OPENING

    def copy(self) -> ReasoningState:
        """An independent state at the same place (`replace` alone would start over)."""
        twin = replace(self)
        twin.phase, twin.count, twin.matched, twin.num_seen = self.phase, self.count, self.matched, self.num_seen
        return twin

    @property
    def in_answer(self) -> bool:
        return self.phase is ReasoningPhase.ANSWER

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Catch up with the sample's output (only the tokens not seen yet are read)."""
        if len(output_token_ids) < self.num_seen:
            self.phase = ReasoningPhase.REASONING if self.starts_in_reasoning else ReasoningPhase.OPENING
            self.count = self.matched = self.num_seen = 0
        self.advance(output_token_ids[self.num_seen:])

    def advance(self, token_ids: Sequence[int]) -> int:
        """Take tokens that follow the output seen so far; return how many of them come
        before the answer (len(token_ids) when the answer has not begun)."""
        for i, token in enumerate(token_ids):
            if self.phase is ReasoningPhase.ANSWER:
                self.num_seen += len(token_ids) - i
                return i
            self._step(token)
            self.num_seen += 1
        return len(token_ids)

    def _step(self, token: int) -> None:
        if self.phase is ReasoningPhase.OPENING:
            self.matched = _extend_match(self.start_token_ids, self.matched, token)
            if self.matched == len(self.start_token_ids):
                self.phase, self.matched = ReasoningPhase.REASONING, 0
            return
        self.count += 1
        self.matched = _extend_match(self.end_token_ids, self.matched, token)
        if self.matched == len(self.end_token_ids):
            self.phase, self.matched = ReasoningPhase.ANSWER, 0

    def forced_token(self) -> int | None:
        """The token the next position must take, or None when the model chooses.

        At the budget the end marker is completed from what of it is already written, so
        the section holds at most `budget` reasoning tokens followed by one whole marker.
        """
        if self.phase is ReasoningPhase.REASONING:
            if self.budget is not None and self.count >= self.budget:
                return self.end_token_ids[self.matched]
        elif self.phase is ReasoningPhase.OPENING and self.force_start:
            return self.start_token_ids[self.matched]
        return None

    def positions(self, draft_token_ids: Sequence[int]) -> list[tuple[int | None, int | None]]:
        """For each position a speculative row verifies (position j follows the first j
        drafts): (its forced token or None, the index in the drafts where the answer
        begins, None while position j is not in the answer). The state itself does not move."""
        walk = self.copy()
        out = []
        answer_start: int | None = 0 if walk.in_answer else None
        for j in range(len(draft_token_ids) + 1):
            out.append((walk.forced_token(), answer_start))
            if j < len(draft_token_ids) and answer_start is None:
                walk.advance(draft_token_ids[j : j + 1])
                if walk.in_answer:
                    answer_start = j + 1
        return out

    def answer_offset(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (following the output seen) come before the answer; the state does not move."""
        return self.copy().advance(token_ids)
