"""pagedserve's own connector, scheduler half: producer leases and consumer loads.

Producer (the prefill instance): a request sent with kv_transfer_params
{"do_remote_decode": true} runs its prefill (max_tokens=1); when it finishes, its
blocks are not freed but handed to the worker half, which serves them to one consumer
and lets go when the consumer acknowledges them or the lease runs out. The request's
response carries the parameters a consumer needs to pull them.

Consumer (the decode instance): a request carrying those parameters loads the prompt's
KV (all of it but the last token, which it computes itself to get logits) instead of
prefilling it; blocks it already has in its prefix cache (same chained hashes, hence
same tokens) are not pulled again. The request waits, holding its blocks, while the
worker half pulls; then it runs as a decode. A load that fails is recomputed or fails
the request (kv_load_failure_policy). A request that will never pull what a producer
holds for it tells the producer to let go at once instead of waiting for the lease.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .block_hash import salt_key
from .kv_connector import KVConnectorMetadata, KVConnectorScheduler, KVTransferConfig
from .request import Request, RequestStatus
from .validation import is_int


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """Where a producer holds a request's KV."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    token_digest: str


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Pull remote.block_ids[i] into local_block_ids[i], for every layer."""

    request_id: str
    remote: RemoteBlocks
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SendSpec:
    """Serve these blocks of a finished request to one consumer, for at most lease_seconds."""

    request_id: str
    block_ids: tuple[int, ...]
    lease_seconds: float


@dataclass(slots=True)
class PagedServeConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    # Producers to tell that a request will never pull its blocks.
    releases: list[RemoteBlocks] = field(default_factory=list)


def token_digest(token_ids: Sequence[int], cache_salt: str | None) -> str:
    """Names a prompt exactly: a consumer loads only KV computed for the same tokens and salt."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids) + salt_key(cache_salt)).hexdigest()


def parse_remote_blocks(params: dict[str, Any]) -> RemoteBlocks:
    """The consumer's view of a producer's kv_transfer_params; ValueError naming the key."""
    def need(key: str, ok, what: str):
        value = params.get(key)
        if not ok(value):
            raise ValueError(f"kv_transfer_params.{key} must be {what}, got {value!r}")
        return value

    block_ids = need("remote_block_ids", lambda v: isinstance(v, list) and v and len(v) <= 1 << 20
                     and all(is_int(b) and b >= 0 for b in v), "a non-empty list of block ids")
    return RemoteBlocks(
        engine_id=need("remote_engine_id", lambda v: isinstance(v, str) and v, "a string"),
        host=need("remote_host", lambda v: isinstance(v, str) and v, "a host name"),
        port=need("remote_port", lambda v: is_int(v) and 0 < v < 65536, "a port number"),
        request_id=need("remote_request_id", lambda v: isinstance(v, str) and v and len(v) <= 1024,
                        "a request id"),
        block_ids=tuple(block_ids),
        num_tokens=need("num_tokens", lambda v: is_int(v) and v >= 1, "a token count >= 1"),
        token_digest=need("token_digest", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex digest"),
    )


@dataclass(slots=True)
class _Recv:
    remote: RemoteBlocks
    # The remote's blocks are dealt with: loaded, or released, or never to be used.
    settled: bool = False


class PagedServeConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, engine_id: str, host: str, port: int):
        self.config = config
        self.block_size = block_size
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self._recvs: dict[str, _Recv] = {}
        # Producer: request id -> blocks held for a consumer.
        self._held: dict[str, int] = {}
        self._meta = PagedServeConnectorMetadata()
        self._num_loading = 0
        self.counters = {"kv_transfer_requests_held": 0, "kv_transfer_loads_started": 0,
                         "kv_transfer_remote_releases": 0}

    # -- requests in ------------------------------------------------------------------

    def validate_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params is None:
            return
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {params!r}")
        if params.get("do_remote_decode"):
            if not self.config.is_producer:
                raise ValueError("kv_transfer_params.do_remote_decode needs kv_role kv_producer or kv_both")
            if request.n != 1:
                raise ValueError(f"kv_transfer_params.do_remote_decode needs n = 1, got {request.n}")
            return
        if "remote_block_ids" not in params:
            return  # nothing to load (e.g. {"do_remote_decode": false})
        if not self.config.is_consumer:
            raise ValueError("kv_transfer_params.remote_block_ids needs kv_role kv_consumer or kv_both")
        remote = parse_remote_blocks(params)
        need = -(-min(remote.num_tokens, request.num_prompt_tokens) // self.block_size)
        if len(remote.block_ids) < need:
            raise ValueError(f"kv_transfer_params.remote_block_ids holds {len(remote.block_ids)} blocks; "
                             f"{remote.num_tokens} tokens need {need}")
        self._recvs[request.request_id] = _Recv(remote)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        recv = self._recvs.get(request.request_id)
        if recv is None or recv.settled:
            return 0, False
        remote = recv.remote
        usable = (remote.num_tokens == request.num_prompt_tokens and not request.skip_prefix_cache
                  and remote.token_digest == token_digest(request.prompt_token_ids, request.cache_salt))
        # The last prompt token is computed here: its logits give the first output token.
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens
        if not usable or num_external <= 0:
            self._release_remote(recv)
            return 0, False
        return num_external, True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        recv = self._recvs[request.request_id]
        bs = self.block_size
        # The prefix hit is whole blocks, so the load starts at a block boundary.
        first = request.num_computed_tokens // bs
        end = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        self._meta.loads.append(LoadSpec(request.request_id, recv.remote, recv.remote.block_ids[first:end],
                                         tuple(block_ids[first:end])))
        recv.settled = True
        self._num_loading += 1
        self.counters["kv_transfer_loads_started"] += 1

    def load_finished(self, request_id: str) -> None:
        self._num_loading -= 1

    # -- steps ------------------------------------------------------------------------

    def build_connector_meta(self) -> PagedServeConnectorMetadata | None:
        meta = self._meta
        if not (meta.loads or meta.sends or meta.releases):
            return None
        self._meta = PagedServeConnectorMetadata()
        return meta

    def has_pending_work(self) -> bool:
        return bool(self._held or self._num_loading)

    # -- requests out -----------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        recv = self._recvs.pop(rid, None)
        if recv is not None and not recv.settled:
            self._release_remote(recv)
        params = request.kv_transfer_params
        if (not params or not params.get("do_remote_decode") or request.status is RequestStatus.FINISHED_ABORTED
                or not block_ids):
            return False, None
        self._held[rid] = len(block_ids)
        self.counters["kv_transfer_requests_held"] += 1
        self._meta.sends.append(SendSpec(rid, tuple(block_ids), self.config.lease_seconds))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids),
            "num_tokens": request.num_prompt_tokens,
            "token_digest": token_digest(request.prompt_token_ids, request.cache_salt),
        }

    def on_finished_sending(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def _release_remote(self, recv: _Recv) -> None:
        recv.settled = True
        self._meta.releases.append(recv.remote)
        self.counters["kv_transfer_remote_releases"] += 1

    def stats(self) -> dict[str, int]:
        return {**self.counters, "kv_transfer_held_requests": len(self._held),
                "kv_transfer_held_blocks": sum(self._held.values()), "kv_transfer_loading_requests": self._num_loading}
