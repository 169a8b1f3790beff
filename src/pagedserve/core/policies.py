"""The batching disciplines of the scheduler study, behind one small interface.

The scheduler asks a policy three things: which waiting request may be admitted
next, how many prompt tokens one step may give a prefill (the prefill rule), and
whether a request that just finished keeps its row as padding. Everything else
(token budget, blocks, preemption) is shared.

- chunked:    continuous batching + chunked prefill (the default).
- continuous: admission and release every step (Orca); every prompt is prefilled
              whole in one step.
- static:     a batch is admitted at once (up to max_num_seqs), nothing else is
              admitted until its last member finishes, and a finished member keeps
              its row, computing one discarded padding token per step.
- naive:      static with a batch of one request (its n samples), i.e. a plain
              generate() loop.
"""
from __future__ import annotations

from collections.abc import Iterable

from .scheduler_config import SchedulerConfig
from .request import Request
from .request_queue import RequestQueue


class ChunkedPrefill:
    """A prefill gets min(remaining, budget left), capped by long_prefill_token_threshold
    so several prompts progress together."""

    chunks = True

    def __init__(self, long_prefill_token_threshold: int = 0):
        self.cap = long_prefill_token_threshold

    def num_tokens(self, remaining: int, budget_left: int, step_is_empty: bool) -> int:
        n = remaining if remaining < budget_left else budget_left
        return n if not self.cap or n <= self.cap else self.cap


class WholePrefill:
    """A prompt is computed in one step. It is admitted only if it fits the budget
    left, except as the first work of an empty step: a prompt longer than the whole
    budget then gets that step to itself (see Scheduler._wants_prefill_step, which
    empties a step for a prompt that cannot fit beside the running decodes)."""

    chunks = False

    def num_tokens(self, remaining: int, budget_left: int, step_is_empty: bool) -> int:
        return remaining if remaining <= budget_left or step_is_empty else 0


class ContinuousBatching:
    """Iteration-level admission and release; the other policies refine its hooks."""

    name = "continuous"

    def __init__(self, prefill: ChunkedPrefill | WholePrefill):
        self.prefill = prefill

    def next_candidate(self, waiting: RequestQueue) -> Request | None:
        return waiting.peek()

    def on_admitted(self, request: Request) -> None:
        pass

    def on_preempted(self, request: Request) -> None:
        pass

    def on_forked(self, children: Iterable[Request]) -> None:
        pass

    def on_finished(self, request: Request, can_pad: bool) -> bool:
        """A request left (finished or aborted). Return True to keep its row computing
        as padding; `can_pad` says it finished on its own while holding a row."""
        return False

    def batch_done(self) -> bool:
        """True once when a closed batch has lost its last member: release its padding."""
        return False

    def end_step(self) -> None:
        pass


class ChunkedBatching(ContinuousBatching):
    name = "chunked"


class StaticBatching(ContinuousBatching):
    """Pad and wait. A batch forms in one step from the head of the queue and then
    closes; only its own preempted members may come back while it lives."""

    name = "static"
    # How many requests (each with its n samples) one batch may take; None = seats only.
    max_requests: int | None = None

    def __init__(self, prefill: ChunkedPrefill | WholePrefill):
        super().__init__(prefill)
        self._members: set[str] = set()  # unfinished members, by request id
        self._waiting_members: set[str] = set()  # members preempted back to the queue
        self._closed = False
        self._formed = 0

    def next_candidate(self, waiting: RequestQueue) -> Request | None:
        if not self._closed:
            if self.max_requests is not None and self._formed >= self.max_requests:
                return None
            return waiting.peek()
        if not self._waiting_members:
            return None
        return next(r for r in waiting if r.request_id in self._waiting_members)

    def on_admitted(self, request: Request) -> None:
        if self._closed:
            self._waiting_members.discard(request.request_id)
        else:
            self._members.add(request.request_id)
            self._formed += 1

    def on_preempted(self, request: Request) -> None:
        self._waiting_members.add(request.request_id)

    def on_forked(self, children: Iterable[Request]) -> None:
        self._members.update(c.request_id for c in children)

    def on_finished(self, request: Request, can_pad: bool) -> bool:
        self._members.discard(request.request_id)
        self._waiting_members.discard(request.request_id)
        return can_pad and bool(self._members)

    def batch_done(self) -> bool:
        if self._closed and not self._members:
            self._closed = False
            self._formed = 0
            return True
        return False

    def end_step(self) -> None:
        if self._members:
            self._closed = True


class NaiveBatching(StaticBatching):
    name = "naive"
    max_requests = 1


def make_policy(config: SchedulerConfig) -> ContinuousBatching:
    if config.chunked_prefill:
        return ChunkedBatching(ChunkedPrefill(config.long_prefill_token_threshold))
    whole_prompt_policies = {
        "chunked": ContinuousBatching,  # enable_chunked_prefill=False
        "continuous": ContinuousBatching,
        "static": StaticBatching,
        "naive": NaiveBatching,
    }
    return whole_prompt_policies[config.policy](WholePrefill())
