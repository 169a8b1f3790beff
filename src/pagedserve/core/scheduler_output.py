"""What the scheduler hands the runner each step, and what update() hands the engine."""
from __future__ import annotations

from dataclasses import dataclass

from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step: compute request.all_token_ids[start : start + num_new_tokens]
    (its last tokens replaced by `draft_token_ids` when it has drafts) at positions
    start .. start + num_new_tokens - 1.

    Block table protocol for the runner, in this order each step: drop state of
    `finished_request_ids` and `preempted_request_ids`; apply `block_copies`; then
    per row: if `block_ids` is not None, the row's table becomes exactly `block_ids`
    (a new or resumed request, or one whose existing entry was replaced by a
    copy-on-write); otherwise append `new_block_ids`.
    """

    request: Request
    request_id: str
    num_new_tokens: int
    # num_computed_tokens before this step: the position of the first token computed.
    start: int
    # First time the runner sees this request (new, resumed after preemption, or a
    # freshly forked child): build its state from scratch.
    is_new: bool
    # Blocks appended to the table this step; the whole table when is_new.
    new_block_ids: tuple[int, ...]
    # The whole table after this step when the runner must replace its row, else None.
    block_ids: tuple[int, ...] | None
    # Tokens to sample from this row's last position: 0 for a partial prefill chunk
    # or padding, 1 normally, n at the fork point of a parallel-sampling request.
    num_samples: int
    # A finished request's row kept computing by the static policy; its outputs
    # are discarded and never streamed.
    is_padding: bool = False
    # Speculative decoding: the proposed tokens computed after the row's last token
    # (the row's last len(draft_token_ids) tokens). num_samples is then
    # 1 + len(draft_token_ids): one per position, verified by the runner, which
    # returns the accepted drafts plus one token of the target's own.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        """The row computes its request's latest sample (and any drafts after it), as
        opposed to prompt tokens. Read it before update() appends this step's tokens."""
        return self.start == len(self.request.all_token_ids) - 1

    @classmethod
    def with_table(cls, request: Request, num_new_tokens: int, start: int, table: tuple[int, ...],
                   num_samples: int, *, drafts: tuple[int, ...] = (), is_padding: bool = False) -> ScheduledRequest:
        """A row the runner builds from scratch (new, resumed or freshly forked): its whole table."""
        return cls(request, request.request_id, num_new_tokens, start, True, table, table, num_samples,
                   is_padding, drafts)

    @classmethod
    def with_new_blocks(cls, request: Request, num_new_tokens: int, start: int, new_block_ids: tuple[int, ...],
                        num_samples: int, *, table: tuple[int, ...] | None = None, drafts: tuple[int, ...] = (),
                        is_padding: bool = False) -> ScheduledRequest:
        """A row the runner already holds: the blocks it gained, and its whole `table`
        when an existing entry changed (copy-on-write, or blocks given back)."""
        return cls(request, request.request_id, num_new_tokens, start, False, new_block_ids, table, num_samples,
                   is_padding, drafts)


@dataclass(slots=True)
class SchedulerOutput:
    # Running decodes (then static padding rows), then prefill chunks, then new requests.
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # (src, dst) block copies to perform before the forward. Apply them as one
    # gather-then-scatter (or in order): a block freed this step can be a source
    # and, reused, a later destination.
    block_copies: list[tuple[int, int]]
    preempted_request_ids: list[str]
    # Finished or aborted (and released) since the previous schedule(); the runner
    # drops any state it keeps for them and ignores ids it does not know.
    finished_request_ids: list[str]
    # The KV connector's metadata for its worker half (None: no connector, or nothing to say).
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """What one update() changed for one request, for streaming.

    A parallel-sampling fork produces an update for the parent and one for each new
    child (request.parent_id / request.index tell them apart).
    """

    request: Request
    new_token_ids: list[int]
    # The finished status reached in this update, None if still running.
    finished: RequestStatus | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finish_reason(self) -> str | None:
        return self.finished.finish_reason if self.finished is not None else None


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    kv_total_blocks: int
    kv_free_blocks: int
    kv_usage: float
    kv_waste: float
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
