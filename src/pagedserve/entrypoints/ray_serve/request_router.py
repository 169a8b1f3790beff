"""The engine deployment's Serve request router: `pagedserve router`'s policy
(router/routing_policies.py, router/choice.py) choosing among Serve's replicas.

Each replica is a router/backends.Backend: its load is the requests this router has in
flight there (as `pagedserve router` counts them), and its cached block hashes come from
the replica's routing stats (replica.py) instead of a KV event stream; between two
reports, the blocks of prompts routed there count as held for `routed_ttl_s`
(Backend.note_routed), so a burst sharing a new prefix follows its first request. The
prompt's keys come with the request (the ingress computed them with the model's
tokenizer, router/prompt_keys.py). The chosen replica is ranked first and the others
after it, so Serve falls back to them when it is full."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ...router.backends import Backend
from ...router.choice import choose_backend
from ...router.routing_policies import Picker
from ...router.prompt_keys import NO_KEYS, PromptKeys
from .asgi_call import ProxiedRequest
from .settings import RouterSettings


class CacheAwareRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **router: Any) -> None:
        """`router`: settings.RouterSettings' fields, as app.deployments passes them."""
        settings = RouterSettings(**router)
        self.picker = Picker(settings.policy, settings.cache())
        self.routed_ttl_s = settings.routed_ttl_s
        self.backends: dict[ReplicaID, Backend] = {}
        self._stats_seen: dict[ReplicaID, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> Sequence[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off, do not spin
        self._forget_gone()
        backends = [self._backend(r) for r in candidate_replicas]
        chosen = choose_backend(self.picker, backends, _keys(pending_request), self.routed_ttl_s)
        first = candidate_replicas[backends.index(chosen)]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def _backend(self, replica: RunningReplica) -> Backend:
        backend = self.backends.get(replica.replica_id)
        if backend is None:
            backend = self.backends[replica.replica_id] = Backend(replica.replica_id.unique_id, healthy=True)
        stats = replica.routing_stats or {}
        if "seq" in stats and self._stats_seen.get(replica.replica_id) != stats["seq"]:
            self._stats_seen[replica.replica_id] = stats["seq"]
            backend.apply({"type": "snapshot", "block_size": stats["block_size"], "hashes": stats["hashes"]})
        return backend

    def _forget_gone(self) -> None:
        for replica_id in set(self.backends) - set(self.curr_replicas):
            del self.backends[replica_id]
            self._stats_seen.pop(replica_id, None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        backend = self.backends.get(replica_id)
        if backend is not None:
            backend.in_flight += 1
            backend.num_requests += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        backend = self.backends.get(replica_id)
        if backend is not None:
            backend.in_flight = max(0, backend.in_flight - 1)


def _keys(pending_request: PendingRequest | None) -> PromptKeys:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], ProxiedRequest):
        return NO_KEYS
    return pending_request.args[0].keys
