"""Beam search over one request (a beam group): transformers' rules, in pure Python.

A group is one request whose `beam_width` members (the request and its forked children,
core/request.py) each hold a live beam. Each step the runner reads every live beam's
log-softmax, adds the beam's cumulative logprob and keeps the group's best
`num_candidates` continuations (worker/beam_candidates.py, one torch.topk over the
flattened candidates); `BeamGroup.advance` then applies transformers' rules
(GenerationMixin._beam_search, transformers 4.5x-5.x):

- a candidate "hits" when its token is a stop token or it reaches max_tokens;
- hits among the best `width` candidates become finished hypotheses, scored
  cumulative logprob / generated_length ** length_penalty (the length counts the
  generated tokens, the stopping one included: transformers' cur_len + 1 - prompt_len);
  only the best `width` hypotheses are kept;
- the best `width` candidates that do not hit continue as the live beams;
- the search ends when no live candidate is left, when `early_stopping` is True and
  `width` hypotheses are finished, or when the best live beam can no longer beat the
  worst kept hypothesis (its score over the current length, or over max_tokens with
  early_stopping "never" and a positive length_penalty).

One deliberate difference: where fewer than `width` candidates live on, transformers
carries placeholder beams scored -1e9; here the group simply has fewer live beams
(their members and blocks are dropped). The results agree wherever those placeholders
could not have mattered (they cannot outscore a real beam).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

@dataclass(frozen=True, slots=True)
class BeamCandidates:
    """A group's best continuations this step, best first: candidate i extends member
    `sources[i]` (its index in the group) by `tokens[i]`, reaching cumulative logprob
    `scores[i]`."""

    sources: list[int]
    tokens: list[int]
    scores: list[float]


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its generated tokens, the stopping one included."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a live continuation goes: member `slot` becomes member `source`'s beam plus `token`."""

    slot: int
    source: int
    token: int


@dataclass(eq=False)
class BeamGroup:
    width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_token_ids: frozenset[int] = frozenset()
    # Cumulative logprob of each live member's beam, by member index.
    scores: dict[int, float] = field(default_factory=lambda: {0: 0.0})
    # Finished, best first; at most `width`.
    hypotheses: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    # transformers' is_early_stop_heuristic_unsatisfied: once False, nothing can improve.
    improvable: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        if self.width < 1 or self.max_tokens < 1:
            raise ValueError(f"beam_width ({self.width}) and max_tokens ({self.max_tokens}) must be >= 1")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")

    @property
    def num_candidates(self) -> int:
        """Continuations kept per step: enough that `width` survive even if every stop token is among them."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    @property
    def is_full(self) -> bool:
        return len(self.hypotheses) >= self.width

    def advance(self, candidates: BeamCandidates, outputs: Mapping[int, Sequence[int]]) -> list[tuple[int, int, float]]:
        """Apply one step's candidates (best first); `outputs` holds each live member's
        generated tokens. Returns the live continuations (source, token, cumulative
        logprob), best first; sets `done` when the search is over."""
        length = self.num_generated + 1
        self.num_generated = length
        at_max = length >= self.max_tokens
        stops = self.stop_token_ids
        triples = list(zip(candidates.sources, candidates.tokens, candidates.scores))
        hits = [at_max or token in stops for _, token, _ in triples]
        if self.improvable and not (self.early_stopping is True and self.is_full):
            penalty = length ** self.length_penalty
            new = [Hypothesis((*outputs[source], token), score, score / penalty,
                              "stop" if token in stops else "length")
                   for (source, token, score), hit in zip(triples[: self.width], hits) if hit]
            if new:
                # A stable sort: on equal scores the earlier hypothesis stays ahead.
                self.hypotheses = sorted(self.hypotheses + new, key=lambda h: h.score, reverse=True)[: self.width]
        live = [t for t, hit in zip(triples, hits) if not hit][: self.width]
        if live and self.is_full:
            best_length = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
            if live[0][2] / best_length ** self.length_penalty <= self.hypotheses[-1].score:
                self.improvable = False
        self.done = not live or not self.improvable or (self.early_stopping is True and self.is_full)
        return [] if self.done else live

    def place(self, live: list[tuple[int, int, float]], slots: Sequence[int]) -> tuple[list[Placement], list[int]]:
        """Seat each live continuation in a member slot, its own source's where that is free
        (so most beams extend in place and only the others re-point their blocks). Returns
        the placements and the slots left empty (members to drop); records the new scores."""
        free = set(slots)
        seat: list[int | None] = [None] * len(live)
        for i, (source, _, _) in enumerate(live):
            if source in free:
                free.discard(source)
                seat[i] = source
        rest = sorted(free)
        for i, slot in enumerate(seat):
            if slot is None:
                seat[i] = rest.pop(0)
        self.scores = {slot: score for slot, (_, _, score) in zip(seat, live)}
        return [Placement(slot, source, token) for slot, (source, token, _) in zip(seat, live)], rest

    def best(self, n: int) -> list[Hypothesis]:
        return self.hypotheses[:n]
