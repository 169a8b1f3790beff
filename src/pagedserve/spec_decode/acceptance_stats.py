"""Acceptance counters, in vLLM's terms: a draft is one request's proposals in one
step; position i counts drafts whose first i + 1 tokens were all accepted."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per draft: the accepted ones plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            "spec_accepted_per_pos": list(self.accepted_per_pos),
        }
