"""The KV connector's lifecycle inside the scheduler, beside the batching policy.

The scheduler asks these hooks at four moments of a request's life (added, about to be
admitted, released, and after each step's worker report) and they keep the connector's
own bookkeeping: which requests wait for a load and which finished requests' blocks a
remote reader still holds. `NoTransfers` answers for an engine without a connector, so
the scheduler has one code path for both. The hooks decide; the scheduler still owns
every change to a request's status, its seats and its blocks.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from types import MappingProxyType

from .kv_connector import KVConnectorOutput, KVConnectorScheduler
from .request import Request, RequestStatus


class LoadOutcome(Enum):
    """What the scheduler does with a request whose load the worker reported."""

    ENDED = "ended"  # it finished or was aborted while loading: release its blocks now
    LOADED = "loaded"  # its KV arrived: run from the tokens after it
    RECOMPUTE = "recompute"  # the load failed: run from the local prefix hit
    FAIL = "fail"  # the load failed and kv_load_failure_policy is "fail"


class NoTransfers:
    """No connector: nothing comes from outside, nothing is held after a request ends."""

    loading: Mapping[str, Request] = MappingProxyType({})

    def validate(self, request: Request) -> None:
        if request.kv_transfer_params is not None:
            raise ValueError("kv_transfer_params needs a KV connector (--kv-transfer-config)")

    def external_tokens(self, request: Request, num_local: int) -> int | None:
        return 0

    def start_loading(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        raise AssertionError("no connector: nothing to load")

    def release(self, request: Request, block_ids: Sequence[int]) -> bool:
        return False

    def worker_report(self, output: KVConnectorOutput) \
            -> tuple[list[Request], list[tuple[Request, LoadOutcome, int]]]:
        return [], []

    def metadata(self) -> object | None:
        return None

    def has_pending_work(self) -> bool:
        return False

    def stats(self) -> dict[str, int] | None:
        return None

    def check_invariants(self, has_blocks: Callable[[Request], bool], live_ids: Mapping[str, Request]) -> None:
        pass


class TransferHooks:
    """A connector's scheduler half, with the requests it is loading or holding."""

    def __init__(self, connector: KVConnectorScheduler):
        self.connector = connector
        # Loads in flight (status WAITING_FOR_REMOTE_KVS, or ended while loading: their blocks stay until
        # the worker stops writing them), and finished requests whose blocks a remote
        # reader may still pull.
        self.loading: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        # Where each load in flight leaves the request's computed tokens once it arrives.
        self._load_ends: dict[str, int] = {}

    def validate(self, request: Request) -> None:
        self.connector.validate_request(request)

    def external_tokens(self, request: Request, num_local: int) -> int | None:
        """Tokens after the local prefix hit that a load will bring (None: ask again later)."""
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_local)
        return num_external

    def start_loading(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        self.loading[request.request_id] = request
        self._load_ends[request.request_id] = request.num_computed_tokens + num_external
        self.connector.update_state_after_alloc(request, block_ids, num_external)

    def release(self, request: Request, block_ids: Sequence[int]) -> bool:
        """A request left: True when the connector holds its blocks for a remote reader
        (the scheduler must not free them yet). Sets the client's hand-off."""
        delay_free, request.kv_transfer_result = self.connector.request_finished(request, block_ids)
        if delay_free:
            self.held[request.request_id] = request
        return delay_free

    def worker_report(self, output: KVConnectorOutput) \
            -> tuple[list[Request], list[tuple[Request, LoadOutcome, int]]]:
        """The requests whose held blocks may be freed now, and each reported load's
        outcome with the computed tokens a done load leaves, in the worker's order (done
        loads first)."""
        freed = []
        for rid in output.finished_sending:
            req = self.held.pop(rid, None)
            if req is not None:
                self.connector.on_finished_sending(rid)
                freed.append(req)
        outcomes = []
        for rid in (*output.finished_recving, *output.failed_recving):
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            self.connector.load_finished(rid)
            end = self._load_ends.pop(rid)
            if req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                outcomes.append((req, LoadOutcome.ENDED, end))
            elif rid in output.finished_recving:
                outcomes.append((req, LoadOutcome.LOADED, end))
            elif self.connector.config.kv_load_failure_policy == "fail":
                outcomes.append((req, LoadOutcome.FAIL, end))
            else:
                outcomes.append((req, LoadOutcome.RECOMPUTE, end))
        return freed, outcomes

    def metadata(self) -> object | None:
        return self.connector.build_connector_meta()

    def has_pending_work(self) -> bool:
        return self.connector.has_pending_work()

    def stats(self) -> dict[str, int] | None:
        return self.connector.stats()

    def check_invariants(self, has_blocks: Callable[[Request], bool], live_ids: Mapping[str, Request]) -> None:
        for r in self.loading.values():
            if not has_blocks(r):
                raise AssertionError(f"loading request {r.request_id} holds no blocks")
        for rid, r in self.held.items():
            if not r.is_finished or not has_blocks(r) or rid in live_ids:
                raise AssertionError(f"held request {rid} must be finished, released and hold blocks")
