"""The KV-connector interface, scheduler side, after vLLM V1's KVConnectorBase_V1.

A connector moves a request's KV blocks between engine instances (disaggregated
prefill/decode). It has two halves: this one runs inside the Scheduler and decides
*which* tokens come from outside and what happens to a finished request's blocks;
the worker half (`pagedserve.kv_transfer`) moves the bytes. They talk only through
the per-step metadata this half builds in schedule() and the KVConnectorOutput the
worker half reports back after each step, so either could live in another process.

Without a configured connector the Scheduler never calls any of this.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .request import Request
from .validation import config_object, is_int

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
KV_CONNECTORS = ("PagedServeConnector",)


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config` (JSON). kv_port 0 picks a free port (the producer reports
    the one it bound in kv_transfer_params)."""

    kv_connector: str = "PagedServeConnector"
    kv_role: str = "kv_both"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_load_failure_policy: str = "recompute"
    # Blocks a producer holds for a consumer that never pulls them go back after this.
    lease_seconds: float = 30.0
    # A pull that sends or receives nothing for this long is abandoned.
    transfer_timeout_seconds: float = 10.0
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be one of "
                             f"{list(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_host, str) or not self.kv_host:
            raise ValueError(f"kv_transfer_config.kv_host must be a host name, got {self.kv_host!r}")
        if not is_int(self.kv_port) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        for name in ("lease_seconds", "transfer_timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise ValueError(f"kv_transfer_config.{name} must be a number of seconds > 0, got {value!r}")
        if self.engine_id is not None and (not isinstance(self.engine_id, str) or not self.engine_id):
            raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, got {self.engine_id!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = config_object("kv_transfer_config", value, {f.name for f in fields(cls)})
        return cls(**value)


class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step (connector-specific)."""


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports after a step, by request id."""

    # Producer: blocks held for a consumer may be freed (it has them, or the lease ran out).
    finished_sending: set[str] = field(default_factory=set)
    # Consumer: loads complete; the request can compute its remaining tokens.
    finished_recving: set[str] = field(default_factory=set)
    # Consumer: loads that failed; kv_load_failure_policy decides what follows.
    failed_recving: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnectorScheduler(ABC):
    """The scheduler half. Every method runs on the scheduler's thread."""

    config: KVTransferConfig  # the scheduler reads kv_load_failure_policy from it

    @abstractmethod
    def validate_request(self, request: Request) -> None:
        """At add_request: raise ValueError (naming the kv_transfer_params key) if the
        request's transfer parameters cannot be honoured."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after the `num_computed_tokens` found locally (the prefix-cache hit)
        that can be had from outside, and whether they arrive asynchronously (the
        request then waits, holding its blocks, until the worker reports the load).
        None: not known yet, ask again next step. Must not change state a retry
        would see differently (the allocation that follows may fail)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks are allocated for the request (its whole table, prefix hit first);
        the last tokens up to num_computed + num_external_tokens are to be loaded."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """The step's metadata for the worker half, then forget it (None: nothing to say)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request left (finished or aborted). Returns (delay_free, kv_transfer_params):
        delay_free keeps its blocks until the worker reports them sent; the params go
        back to the client (a producer's hand-off to the decode instance)."""

    @abstractmethod
    def has_pending_work(self) -> bool:
        """Blocks held or loads in flight: the engine must keep stepping to hear of them."""

    @abstractmethod
    def load_finished(self, request_id: str) -> None:
        """The worker reported a request's load, done or failed."""

    @abstractmethod
    def on_finished_sending(self, request_id: str) -> None:
        """The worker let go of a held request's blocks (before the scheduler frees them)."""

    def stats(self) -> dict[str, int]:
        """Counters for /metrics, by name."""
        return {}
