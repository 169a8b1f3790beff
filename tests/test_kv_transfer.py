"""The KV-transfer wire format and the worker half of pagedserve's connector, in one process.

Two workers over loopback TCP with small random caches: a pull copies exactly the asked
blocks (fp32 and fp8 bytes alike) and frees the producer's hold; a cache of another
layout, an unknown request and an expired lease fail the load; RELEASE frees a hold.
"""
from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from pagedserve.core.kv_connector import KVTransferConfig
from pagedserve.core.pd_connector import LoadSpec, PagedServeConnectorMetadata, RemoteBlocks, SendSpec
from pagedserve.kv_transfer.frame import (FRAME_VERSION, HEADER, Frame, FrameError, Kind, decode, encode, read_frame,
                                          send_frame)
from pagedserve.kv_transfer.pagedserve_connector import PagedServeConnectorWorker

# -- frames ------------------------------------------------------------------------------


def test_frames_round_trip():
    payload = torch.arange(2 * 3 * 4 * 2 * 5, dtype=torch.float32).numpy().tobytes()
    frames = [
        Frame(Kind.PULL, "cmpl-1-0", block_ids=(7, 3, 9)),
        Frame(Kind.LAYER, "cmpl-1-0", 29, (7, 3, 9), "float32", (2, 3, 4, 2, 5), payload),
        Frame(Kind.DONE, "é-unicode"),
        Frame(Kind.ERROR, "x", payload=b"no such request"),
        Frame(Kind.RELEASE, "x"),
    ]
    for frame in frames:
        back = decode(encode(frame))
        assert back == Frame(frame.kind, frame.request_id, frame.layer, tuple(frame.block_ids), frame.dtype,
                             tuple(frame.shape), bytearray(frame.payload))


def test_the_header_is_explicit_little_endian():
    data = encode(Frame(Kind.LAYER, "r", 2, (5,), "float16", (1, 2), b"\x01\x02\x03\x04"))
    assert data[:4] == b"PSKV"
    assert struct.unpack_from("<HBBIIHB", data, 4) == (FRAME_VERSION, Kind.LAYER, 2, 2, 1, 1, 2)
    assert struct.unpack_from("<Q", data, 20) == (4,)
    assert data[HEADER.size:] == b"r" + struct.pack("<i", 5) + struct.pack("<2I", 1, 2) + b"\x01\x02\x03\x04"


@pytest.mark.parametrize("mutate, match", [
    (lambda d: b"XXXX" + d[4:], "not a pagedserve KV frame"),
    (lambda d: d[:4] + struct.pack("<H", FRAME_VERSION + 1) + d[6:], "frame version"),
    (lambda d: d[:6] + b"\x09" + d[7:], "unknown frame kind"),
    (lambda d: d[:7] + b"\x63" + d[8:], "unknown dtype"),
    (lambda d: d[:-1], "connection closed"),
    (lambda d: d + b"\x00", "bytes after the frame"),
    (lambda d: d[:20] + struct.pack("<Q", 6) + d[28:] + b"\x00\x00", "does not hold"),
])
def test_bad_frames_are_refused(mutate, match):
    data = encode(Frame(Kind.LAYER, "r", 0, (1,), "float32", (1,), b"\x00" * 4))
    with pytest.raises(FrameError, match=match):
        decode(mutate(data))


def test_an_encoder_refuses_a_payload_that_does_not_match_its_shape():
    with pytest.raises(FrameError, match="does not hold"):
        encode(Frame(Kind.LAYER, "r", 0, (1,), "float32", (2,), b"\x00" * 4))


def test_frames_cross_a_socket():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, Frame(Kind.LAYER, "r", 1, (4,), "float8_e4m3fn", (3,), memoryview(b"abc")))
        assert read_frame(b) == Frame(Kind.LAYER, "r", 1, (4,), "float8_e4m3fn", (3,), bytearray(b"abc"))


# -- the worker half -------------------------------------------------------------------------

NUM_BLOCKS, LAYERS, SHAPE = 8, 3, (4, 2, 8)  # block_size, kv heads, head dim


def caches(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, NUM_BLOCKS, *SHAPE), generator=g).to(dtype) for _ in range(LAYERS)]


@pytest.fixture
def workers():
    made = []

    def make(role: str, dtype=torch.float32, seed=0, **config):
        worker = PagedServeConnectorWorker(KVTransferConfig(kv_role=role, transfer_timeout_seconds=5, **config))
        worker.register_kv_caches(caches(dtype, seed))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def remote(producer: PagedServeConnectorWorker, rid: str, block_ids: tuple[int, ...]) -> RemoteBlocks:
    return RemoteBlocks(producer.engine_id, producer.host, producer.port, rid, block_ids, 16, "0" * 64)


def wait_finished(worker: PagedServeConnectorWorker, field: str, rid: str, within_s: float = 10.0) -> set[str]:
    """Collect get_finished() until `rid` shows up in `field`; everything seen per field."""
    seen = {"finished_sending": set(), "finished_recving": set(), "failed_recving": set()}
    deadline = time.monotonic() + within_s
    while rid not in seen[field]:
        assert time.monotonic() < deadline, seen
        worker.wait_for_activity(0.05)
        out = worker.get_finished()
        for name in seen:
            seen[name] |= getattr(out, name)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_pull_copies_exactly_the_asked_blocks_and_frees_the_hold(workers, dtype):
    producer, consumer = workers("kv_producer", dtype, seed=1), workers("kv_consumer", dtype, seed=2)
    producer.bind_connector_metadata(PagedServeConnectorMetadata(sends=[SendSpec("p", (1, 4, 6), 30.0)]))
    before = [kv.clone() for kv in consumer._kv_caches]
    # The consumer has block 1's content cached already: it asks for 4 and 6 only.
    consumer.bind_connector_metadata(PagedServeConnectorMetadata(
        loads=[LoadSpec("d", remote(producer, "p", (1, 4, 6)), (4, 6), (0, 5))]))
    consumer.start_load_kv()
    seen = wait_finished(consumer, "finished_recving", "d")
    assert not seen["failed_recving"]
    for layer, (src, dst, old) in enumerate(zip(producer._kv_caches, consumer._kv_caches, before)):
        assert torch.equal(dst[:, [0, 5]].view(torch.uint8), src[:, [4, 6]].view(torch.uint8)), layer
        untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 5)]
        assert torch.equal(dst[:, untouched].view(torch.uint8), old[:, untouched].view(torch.uint8))
    wait_finished(producer, "finished_sending", "p")
    assert producer.stats()["kv_transfer_blocks_sent"] == 2 and consumer.stats()["kv_transfer_blocks_received"] == 2


def test_a_cache_of_another_layout_fails_the_load(workers):
    producer = workers("kv_producer", torch.float32)
    consumer = workers("kv_consumer", torch.float16)
    producer.bind_connector_metadata(PagedServeConnectorMetadata(sends=[SendSpec("p", (2,), 30.0)]))
    consumer.bind_connector_metadata(PagedServeConnectorMetadata(loads=[LoadSpec("d", remote(producer, "p", (2,)),
                                                                                  (2,), (3,))]))
    consumer.start_load_kv()
    wait_finished(consumer, "failed_recving", "d")
    assert consumer.stats()["kv_transfer_loads_failed"] == 1
    # The producer still holds the blocks once it sees the consumer gone (a failed transfer
    # does not free them; the lease does).
    deadline = time.monotonic() + 10
    while producer._held["p"].busy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not producer._held["p"].busy and not producer.get_finished().finished_sending


def test_unknown_requests_and_blocks_not_held_are_refused(workers):
    producer, consumer = workers("kv_producer"), workers("kv_consumer")
    producer.bind_connector_metadata(PagedServeConnectorMetadata(sends=[SendSpec("p", (2, 3), 30.0)]))
    consumer.bind_connector_metadata(PagedServeConnectorMetadata(loads=[
        LoadSpec("other-blocks", remote(producer, "p", (2, 5)), (2, 5), (0, 1))]))
    consumer.start_load_kv()
    wait_finished(consumer, "failed_recving", "other-blocks")
    assert "p" in producer._held


def test_a_lease_expires_and_a_release_frees_a_hold(workers):
    producer, consumer = workers("kv_producer"), workers("kv_consumer")
    producer.bind_connector_metadata(PagedServeConnectorMetadata(sends=[SendSpec("short", (1,), 0.2),
                                                                        SendSpec("released", (2,), 30.0)]))
    consumer.bind_connector_metadata(PagedServeConnectorMetadata(releases=[remote(producer, "released", (2,))]))
    consumer.start_load_kv()
    wait_finished(producer, "finished_sending", "released")
    time.sleep(0.3)
    assert producer.get_finished().finished_sending == {"short"}
    assert producer.stats()["kv_transfer_leases_expired"] == 1
    assert producer.stats()["kv_transfer_releases_received"] == 1
    # A late consumer of the expired hold fails (and would recompute).
    consumer.bind_connector_metadata(PagedServeConnectorMetadata(loads=[LoadSpec("late", remote(producer, "short", (1,)),
                                                                                  (1,), (0,))]))
    consumer.start_load_kv()
    wait_finished(consumer, "failed_recving", "late", within_s=15)


def test_a_dead_producer_fails_the_load(workers):
    consumer = workers("kv_consumer")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = RemoteBlocks("e", "127.0.0.1", port, "p", (1,), 4, "0" * 64)
    consumer.bind_connector_metadata(PagedServeConnectorMetadata(loads=[LoadSpec("d", dead, (1,), (0,))]))
    consumer.start_load_kv()
    wait_finished(consumer, "failed_recving", "d")
