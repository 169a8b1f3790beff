"""Which replica gets a request: round robin, least load, or where its prefix is cached.

A policy sees only the replicas that are up, each as its in-flight count and (for
cache_aware) how many leading blocks of the prompt it holds. cache_aware minimises

    cost = uncached prompt tokens + load_weight * in-flight requests

so a long cached prefix outweighs a slightly longer queue, and falls back to least load
outright when the replicas are imbalanced: the busiest has more than `balance_abs`
requests over the idlest and more than `balance_rel` times its load.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass(frozen=True, slots=True)
class Candidate:
    index: int  # position in the router's backend list
    load: int  # requests in flight there
    hit_tokens: int = 0  # prompt tokens its prefix cache is expected to serve


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    load_weight: float = 16.0  # prompt tokens one in-flight request is worth
    balance_abs: int = 4
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 1:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")


class Picker:
    def __init__(self, policy: str, cache: CacheAwareConfig = CacheAwareConfig()):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.cache = cache
        self._turn = itertools.count()
        self.num_fallbacks = 0  # cache_aware decisions made by load because of imbalance

    @property
    def needs_keys(self) -> bool:
        return self.policy == "cache_aware"

    def pick(self, candidates: Sequence[Candidate], num_prompt_tokens: int = 0) -> Candidate:
        """One of `candidates` (non-empty); ties go round robin so equal replicas share work."""
        turn = next(self._turn)
        if self.policy == "round_robin":
            return candidates[turn % len(candidates)]
        if self.policy == "cache_aware" and not self._imbalanced(candidates):
            c = self.cache
            return _first_min(candidates, turn,
                              lambda x: (num_prompt_tokens - x.hit_tokens + c.load_weight * x.load, x.load))
        if self.policy == "cache_aware" and any(x.hit_tokens for x in candidates):
            self.num_fallbacks += 1
        return _first_min(candidates, turn, lambda x: x.load)

    def _imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        lo = min(x.load for x in candidates)
        hi = max(x.load for x in candidates)
        return hi - lo > self.cache.balance_abs and hi > self.cache.balance_rel * lo


def _first_min(candidates: Sequence[Candidate], turn: int, key) -> Candidate:
    n = len(candidates)
    rotated = [candidates[(turn + i) % n] for i in range(n)]
    return min(rotated, key=key)
