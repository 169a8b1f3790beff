"""How one request samples, as the engine sets it up and the runner reads it: the
typed value core carries, unopened, in `Request.sampling`."""
from __future__ import annotations

from dataclasses import dataclass, field

from .core.reasoning import ReasoningState
from .sampling_params import SamplingParams, child_seed
from .structured_output.grammar_backend import Matcher


@dataclass(slots=True)
class SamplingState:
    params: SamplingParams
    # A seeded random sample draws output token t from token_seed(seed, t); None otherwise.
    seed: int | None
    # At a parallel-sampling fork, sample i has seed fork_seeds[i].
    fork_seeds: list[int | None] = field(default_factory=list)
    # The grammar matcher of a structured-output request (None otherwise); at a fork,
    # sample i advances fork_matchers[i].
    matcher: Matcher | None = None
    fork_matchers: list[Matcher | None] = field(default_factory=list)
    # Where the sample stands in its thinking section (None: the request has no reasoning markers).
    reasoning: ReasoningState | None = None

    @classmethod
    def for_request(cls, params: SamplingParams, matchers: list[Matcher | None]) -> SamplingState:
        """A new request's state, with one seed and one matcher per sample."""
        if params.seed is None or params.is_greedy:
            seeds: list[int | None] = [None] * params.n
        else:
            seeds = [child_seed(params.seed, i) for i in range(params.n)]
        markers = params.reasoning
        reasoning = None if markers is None else ReasoningState(
            markers.end_token_ids, markers.start_token_ids, markers.starts_in_reasoning,
            params.thinking_token_budget, force_start=params.structured_outputs is not None)
        return cls(params, seeds[0], seeds, matchers[0], matchers, reasoning)

    def for_child(self, index: int) -> SamplingState:
        """Sample `index` of a parallel-sampling fork: from the fork on it draws with its
        own seed, advances its own matcher and counts its own thinking."""
        return SamplingState(self.params, self.fork_seeds[index], matcher=self.fork_matchers[index],
                             reasoning=self.reasoning.copy() if self.reasoning is not None else None)
