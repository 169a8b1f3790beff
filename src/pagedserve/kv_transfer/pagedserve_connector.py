"""pagedserve's connector, worker half: a TCP block server (producer) and pulls (consumer).

Producer: a listening socket, one thread per connection. A held request's blocks are
served once, to the first consumer that asks with a subset of its block ids; they are
let go (reported as finished sending) when that consumer acknowledges them, when it
sends RELEASE, or when the lease runs out without a transfer in progress. A transfer in
progress pins the blocks, so a lease never expires under a reader.

Consumer: each load runs on a small thread pool, beside the engine's steps: connect,
PULL, then one LAYER frame per layer, written into the local blocks as it arrives
(the producer is already gathering and sending the next layer meanwhile), then DONE.
Any error (refused connection, timeout, a frame that does not match the local cache's
layout) reports the load as failed; the scheduler half then applies the failure policy.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..core.kv_connector import KVConnectorOutput, KVTransferConfig
from ..core.kv_tensor_layout import KVTensorLayout
from ..core.pd_connector import LoadSpec, PagedServeConnectorMetadata, RemoteBlocks, SendSpec
from .base import KVConnectorWorker
from .frame import Frame, FrameError, Kind, read_frame, send_frame

logger = logging.getLogger(__name__)

# How long a PULL may wait for its request to be registered: the producer's response
# can reach the consumer just before the engine's next step publishes the hold.
REGISTRATION_WAIT_SECONDS = 5.0
_LOAD_THREADS = 4
# Ids of holds that ended, remembered so a late PULL is refused at once rather than
# after the registration wait.
_GONE_IDS = 4096


@dataclass(slots=True)
class _Held:
    block_ids: frozenset[int]
    deadline: float
    busy: bool = False


class _LoadError(RuntimeError):
    pass


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PagedServeConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.host = config.kv_host
        self.port = config.kv_port
        self._kv_caches: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._finished = KVConnectorOutput()
        self._activity = threading.Event()
        self._loads: list[LoadSpec] = []
        self._releases: list[RemoteBlocks] = []
        self._closed = False
        self._pool = ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix="kv-load")
        self.counters = {name: 0 for name in (
            "kv_transfer_blocks_sent", "kv_transfer_blocks_received", "kv_transfer_loads_failed",
            "kv_transfer_leases_expired", "kv_transfer_releases_received")}
        self._server: socket.socket | None = None
        if config.is_producer:
            self._server = socket.create_server((config.kv_host, config.kv_port))
            self.port = self._server.getsockname()[1]
            threading.Thread(target=self._accept_loop, name="kv-server", daemon=True).start()
            logger.info("KV transfer: serving blocks on %s:%d (engine %s)", self.host, self.port, self.engine_id)

    # -- the engine's side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches)

    def bind_connector_metadata(self, metadata: PagedServeConnectorMetadata | None) -> None:
        if metadata is None:
            return
        if metadata.sends:
            now = time.monotonic()
            with self._cond:
                for send in metadata.sends:
                    self._hold(send, now)
                self._cond.notify_all()
        self._loads += metadata.loads
        self._releases += metadata.releases

    def _hold(self, send: SendSpec, now: float) -> None:
        self._held[send.request_id] = _Held(frozenset(send.block_ids), now + send.lease_seconds)

    def start_load_kv(self) -> None:
        loads, self._loads = self._loads, []
        releases, self._releases = self._releases, []
        for spec in loads:
            self._pool.submit(self._load, spec)
        for remote in releases:
            self._pool.submit(self._send_release, remote)

    def get_finished(self) -> KVConnectorOutput:
        now = time.monotonic()
        with self._cond:
            for rid in [rid for rid, h in self._held.items() if not h.busy and now > h.deadline]:
                self._let_go(rid)
                self.counters["kv_transfer_leases_expired"] += 1
            out, self._finished = self._finished, KVConnectorOutput()
        return out

    def wait_for_activity(self, timeout: float) -> None:
        if self._activity.wait(timeout):
            self._activity.clear()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self.counters)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _report(self, kind: str, request_id: str) -> None:
        """Called with the lock held."""
        getattr(self._finished, kind).add(request_id)
        self._activity.set()

    def _let_go(self, request_id: str) -> None:
        """End a hold: the scheduler half may free its blocks. Called with the lock held."""
        del self._held[request_id]
        self._gone[request_id] = None
        if len(self._gone) > _GONE_IDS:
            self._gone.popitem(last=False)
        self._report("finished_sending", request_id)

    # -- producer: serving held blocks ------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kv-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.config.transfer_timeout_seconds)
        with conn:
            try:
                frame = read_frame(conn)
                if frame.kind is Kind.RELEASE:
                    with self._cond:
                        held = self._held.get(frame.request_id)
                        if held is not None and not held.busy:
                            self._let_go(frame.request_id)
                            self.counters["kv_transfer_releases_received"] += 1
                    return
                if frame.kind is not Kind.PULL:
                    raise FrameError(f"expected PULL or RELEASE, got {frame.kind.name}")
                self._send_blocks(conn, frame)
            except (OSError, FrameError) as e:
                logger.warning("KV transfer: serving a consumer failed: %s", e)

    def _claim(self, request_id: str, block_ids: tuple[int, ...]) -> str | None:
        """Pin the request's blocks for one transfer; the reason it cannot be, or None."""
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._held or request_id in self._gone or self._closed,
                                REGISTRATION_WAIT_SECONDS)
            held = self._held.get(request_id)
            if held is None:
                return f"request {request_id!r} holds no blocks here (released, expired or unknown)"
            if held.busy:
                return f"request {request_id!r} is being sent to another consumer"
            if not block_ids or not held.block_ids.issuperset(block_ids):
                return f"block ids asked for are not those of request {request_id!r}"
            held.busy = True
            return None

    def _send_blocks(self, conn: socket.socket, pull: Frame) -> None:
        rid = pull.request_id
        refusal = self._claim(rid, pull.block_ids)
        if refusal is not None:
            send_frame(conn, Frame(Kind.ERROR, rid, payload=refusal.encode()))
            return
        done = False
        try:
            index = torch.tensor(pull.block_ids, dtype=torch.int64)
            with torch.inference_mode():
                for layer, kv in enumerate(self._kv_caches):
                    # K and V of the asked blocks, moved as bytes (torch has no index ops for
                    # the fp8 types).
                    data = kv.view(torch.uint8).index_select(1, index)
                    shape = KVTensorLayout.of(kv).blocks_shape(len(index))
                    send_frame(conn, Frame(Kind.LAYER, rid, layer, pull.block_ids, _dtype_name(kv.dtype), shape,
                                           memoryview(data.reshape(-1).numpy())))
            ack = read_frame(conn)
            done = ack.kind is Kind.DONE and ack.request_id == rid
        finally:
            with self._cond:
                held = self._held.get(rid)
                if done:
                    self._let_go(rid)
                    self.counters["kv_transfer_blocks_sent"] += len(pull.block_ids)
                elif held is not None:
                    held.busy = False  # a failed transfer: the lease still bounds the hold

    # -- consumer: pulling ------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> None:
        remote = spec.remote
        ok = False
        try:
            with socket.create_connection((remote.host, remote.port), self.config.transfer_timeout_seconds) as s:
                send_frame(s, Frame(Kind.PULL, remote.request_id, block_ids=spec.remote_block_ids))
                local = torch.tensor(spec.local_block_ids, dtype=torch.int64)
                with torch.inference_mode():
                    for layer, kv in enumerate(self._kv_caches):
                        frame = read_frame(s)
                        if frame.kind is Kind.ERROR:
                            raise _LoadError(bytes(frame.payload).decode(errors="replace"))
                        expected = KVTensorLayout.of(kv).blocks_shape(len(local))
                        if (frame.kind is not Kind.LAYER or frame.layer != layer
                                or frame.block_ids != spec.remote_block_ids or frame.dtype != _dtype_name(kv.dtype)
                                or frame.shape != expected):
                            raise _LoadError(f"layer {layer}: got {frame.kind.name} layer {frame.layer} "
                                             f"{frame.dtype} {frame.shape}, expected {_dtype_name(kv.dtype)} {expected}")
                        raw = kv.view(torch.uint8)  # head_dim x itemsize bytes per row
                        raw.index_copy_(1, local, torch.frombuffer(frame.payload, dtype=torch.uint8).view(
                            KVTensorLayout.of(raw).blocks_shape(len(local))))
                send_frame(s, Frame(Kind.DONE, remote.request_id))
            ok = True
        except Exception as e:  # any failure must be reported, or the request would wait forever
            logger.warning("KV transfer: loading request %s from %s:%d failed: %s", spec.request_id, remote.host,
                           remote.port, e)
        with self._cond:
            if ok:
                self.counters["kv_transfer_blocks_received"] += len(spec.local_block_ids)
                self._report("finished_recving", spec.request_id)
            else:
                self.counters["kv_transfer_loads_failed"] += 1
                self._report("failed_recving", spec.request_id)

    def _send_release(self, remote: RemoteBlocks) -> None:
        try:
            with socket.create_connection((remote.host, remote.port), self.config.transfer_timeout_seconds) as s:
                send_frame(s, Frame(Kind.RELEASE, remote.request_id))
        except OSError as e:
            # The producer's lease frees the blocks anyway.
            logger.info("KV transfer: could not release request %s at %s:%d: %s", remote.request_id, remote.host,
                        remote.port, e)
