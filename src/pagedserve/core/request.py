"""A request as the scheduler sees it: token ids plus how many of them are computed.

Prefill, a prefill chunk, a decode step, a prefix-cache hit and recompute after
preemption are all `num_computed_tokens` catching up to `num_tokens`.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from .beam_search import BeamGroup
from .validation import is_int, require_int

CHILD_ID_SEPARATOR = "#"
# How a pooling request turns its prompt's final hidden states into one vector: the
# last token's, the mean over every token, or the first token's (a BERT-style CLS).
POOLING_TYPES = ("last", "mean", "cls")


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Admitted with blocks, waiting for a KV connector to load part of its prompt.
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    # Structured output reached a point no token of the vocabulary can continue.
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort", "error"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class ImageSpan(NamedTuple):
    """The prompt tokens [offset, offset + length) that one image expanded into (its
    placeholder's run: the image tokens that take the encoder's output, and the tokens
    around them), and the image's content hash (the encoder cache's key and part of the
    prefix-cache key of every block the run touches)."""

    offset: int
    length: int
    content_hash: str


class SampleState(Protocol):
    """How a request samples (the engine's SamplingState). Core never looks inside;
    it only asks, at a parallel-sampling fork, for the state of sample `index`."""

    def for_child(self, index: int) -> SampleState: ...


@dataclass(slots=True, eq=False, repr=False)
class Request:
    """One sequence. Equality is identity: two requests are never interchangeable."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    # Lower value = more important, as in vLLM.
    priority: int = 0
    min_tokens: int = 0
    n: int = 1
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    cache_salt: str | None = None
    # The LoRA adapter the request runs (0: the base model). An id names one load of an
    # adapter and is never reused, so it keys the prefix cache (core/block_hash.py).
    lora_id: int = 0
    # Compute the whole prompt even when the prefix cache holds some of it (prompt
    # logprobs need the logits of every prompt position; cached blocks have none).
    skip_prefix_cache: bool = False
    sampling: SampleState | None = None
    # Disaggregated prefill/decode: what the KV connector should do with this request
    # (core/pd_connector.py reads it; None without a connector).
    kv_transfer_params: dict | None = None
    parent_id: str | None = None
    index: int = 0
    # A pooling request (one of POOLING_TYPES; None: generation) computes its prompt and
    # finishes when the prompt is done: it never samples, and max_tokens is not reserved.
    pooling: str | None = None
    # Beam search: the group every member (this request and its forked children, n = the
    # beam width) shares; None for sampling.
    beam: BeamGroup | None = None
    # A vision model's images, in prompt order (none: a text-only prompt).
    images: tuple[ImageSpan, ...] = ()

    output_token_ids: list[int] = field(init=False)
    # Prompt + outputs in one list that only grows, so a step's token slice is cheap.
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_preemptions: int = field(init=False, default=0)
    num_priority_preemptions: int = field(init=False, default=0)  # as a priority victim (scheduler)
    # Prefix-cache hit in tokens at the first admission; None until then.
    num_cached_tokens: int | None = field(init=False, default=None)
    # The stop token id that ended the request (or a stop string the engine set).
    stop_reason: int | str | None = field(init=False, default=None)
    # Chained hashes of full blocks, extended lazily; each block is hashed once.
    block_hashes: list[bytes] = field(init=False)
    # True until a parallel-sampling parent has forked its n - 1 children.
    fork_pending: bool = field(init=False)
    # Speculative decoding: tokens a proposer suggests to follow all_token_ids, set
    # between steps by Scheduler.update_draft_token_ids and consumed by the next schedule().
    spec_token_ids: list[int] = field(init=False)
    # Draft tokens computed this step and not yet verified: counted in
    # num_computed_tokens until update() keeps the accepted ones and rolls back the rest.
    num_unverified_tokens: int = field(init=False, default=0)
    # Set when the request is released: the connector's hand-off for the client.
    kv_transfer_result: dict | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids must hold at least one token")
        require_int("max_tokens", self.max_tokens, 1)
        require_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        require_int("n", self.n, 1)
        if not is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.eos_token_id is not None:
            require_int("eos_token_id", self.eos_token_id, 0)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {self.cache_salt!r}")
        require_int("lora_id", self.lora_id, 0)
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES} or None, got {self.pooling!r}")
        if self.pooling is not None and self.n != 1:
            raise ValueError(f"a pooling request has one result: n must be 1, got {self.n}")
        self.images = tuple(self.images)
        end = 0
        for span in self.images:
            if not (is_int(span.offset) and is_int(span.length) and span.offset >= end and span.length >= 1
                    and span.offset + span.length <= len(self.prompt_token_ids) and isinstance(span.content_hash, str)):
                raise ValueError(f"images: span {span!r} must lie in the prompt, after the previous one")
            end = span.offset + span.length
        self.output_token_ids = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = []
        self.fork_pending = self.n > 1
        self.spec_token_ids = []

    def __repr__(self) -> str:
        # Token lists and hashes make the generated repr unreadable in test failures.
        status = getattr(self, "status", RequestStatus.WAITING).name
        return (f"Request({self.request_id!r}, {status}, prompt={len(self.prompt_token_ids)}, "
                f"computed={getattr(self, 'num_computed_tokens', 0)}, outputs={len(getattr(self, 'output_token_ids', ()))})")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def num_reserved_tokens(self) -> int:
        """The length the request may reach: its prompt, plus max_tokens unless it pools."""
        return self.num_prompt_tokens + (0 if self.pooling is not None else self.max_tokens)

    @property
    def is_decode(self) -> bool:
        """Only the last token (the latest sample) is left to compute."""
        return len(self.all_token_ids) - self.num_computed_tokens == 1

    @property
    def max_draft_tokens(self) -> int:
        """Speculative tokens a step may verify for this request: as many as its
        remaining output can hold beside the target's own token (<= 0: none)."""
        return self.max_tokens - len(self.output_token_ids) - 1

    @property
    def num_verified_tokens(self) -> int:
        """Computed tokens whose KV is final: everything but this step's draft tokens."""
        return self.num_computed_tokens - self.num_unverified_tokens

    @property
    def num_seats(self) -> int:
        """Running slots this request holds against max_num_seqs: n until it forks."""
        return self.n if self.fork_pending else 1

    def append_output_token(self, token_id: int) -> RequestStatus | None:
        """Append one sampled token; return the finished status it causes, if any."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_output = len(self.output_token_ids)
        # min_tokens only suppresses stopping here; keeping EOS / stop ids from being
        # sampled at all before min_tokens is the sampler's job.
        if num_output >= self.min_tokens:
            if token_id == self.eos_token_id and not self.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in self.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_child(self, index: int, block_size: int) -> Request:
        """The index-th parallel sample: this request's tokens and computed prefix, n = 1.

        It inherits only the hashes of blocks that lie wholly inside the shared,
        computed prefix; later blocks will hold its own tokens.
        """
        child = replace(
            self,
            request_id=f"{self.request_id}{CHILD_ID_SEPARATOR}{index}",
            n=1,
            sampling=self.sampling.for_child(index) if self.sampling is not None else None,
            parent_id=self.request_id,
            index=index,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = self.block_hashes[: self.num_computed_tokens // block_size]
        child.status = RequestStatus.RUNNING
        return child

    def token_state(self) -> TokenState:
        """A copy of the tokens and computed prefix, for another beam to adopt."""
        return TokenState(list(self.output_token_ids), list(self.all_token_ids), self.num_computed_tokens,
                          list(self.block_hashes))

    def adopt(self, state: TokenState) -> None:
        """Become another beam (beam search re-points a member): its tokens and computed
        prefix; the KV cache re-points the blocks to match."""
        self.output_token_ids = state.output_token_ids
        self.all_token_ids = state.all_token_ids
        self.num_computed_tokens = state.num_computed_tokens
        self.block_hashes = state.block_hashes


@dataclass(frozen=True, slots=True)
class TokenState:
    output_token_ids: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]

