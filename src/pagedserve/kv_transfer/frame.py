"""The wire format of pagedserve's KV transfer: explicit binary frames, no pickle.

Every frame is a fixed 28-byte little-endian header, then its variable parts:

    magic    4s   b"PSKV"
    version  u16  FRAME_VERSION (a peer speaking another version is refused)
    kind     u8   PULL, LAYER, DONE, ERROR or RELEASE
    dtype    u8   element type of the payload (DTYPES; 0 when there is none)
    layer    u32  the layer a LAYER frame carries
    nblocks  u32  how many block ids follow
    rid_len  u16  bytes of the request id that follow
    ndim     u8   dimensions of the payload's shape that follow
    (pad)    1
    nbytes   u64  payload bytes
    request id   rid_len bytes, UTF-8
    block ids    nblocks x i32
    shape        ndim x u32
    payload      nbytes raw bytes (LAYER: the blocks' K and V, C order; ERROR: a UTF-8 message)

A consumer sends PULL (the producer's request id and the block ids it wants); the
producer answers with one LAYER frame per layer (shape `KVTensorLayout.blocks_shape(nblocks)`
of core/kv_tensor_layout.py: K then V) or an ERROR; the consumer acknowledges with DONE, which
lets the producer free the blocks. RELEASE (consumer -> producer) says the request will
never pull, so the blocks go back at once instead of when the lease runs out.
"""
from __future__ import annotations

import enum
import math
import socket
import struct
from dataclasses import dataclass

MAGIC = b"PSKV"
FRAME_VERSION = 1
HEADER = struct.Struct("<4sHBBIIHBxQ")
MAX_REQUEST_ID_BYTES = 1024
MAX_BLOCKS = 1 << 20
MAX_NDIM = 8
MAX_PAYLOAD_BYTES = 1 << 34


class Kind(enum.IntEnum):
    PULL = 1
    LAYER = 2
    DONE = 3
    ERROR = 4
    RELEASE = 5


# Element type name -> (code, item size). Names are torch's without the prefix.
DTYPES = {"float32": (1, 4), "float16": (2, 2), "bfloat16": (3, 2), "float8_e4m3fn": (4, 1), "float8_e5m2": (5, 1)}
_DTYPE_NAMES = {code: name for name, (code, _) in DTYPES.items()}


class FrameError(ValueError):
    """A frame that is malformed, from another protocol or version, or cut short."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    request_id: str
    layer: int = 0
    block_ids: tuple[int, ...] = ()
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    payload: bytes | bytearray | memoryview = b""


def encode_header(frame: Frame) -> bytes:
    """Everything but the payload (sent after it without a copy)."""
    rid = frame.request_id.encode("utf-8")
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise FrameError(f"request id is {len(rid)} bytes; at most {MAX_REQUEST_ID_BYTES}")
    if len(frame.block_ids) > MAX_BLOCKS or len(frame.shape) > MAX_NDIM:
        raise FrameError("too many block ids or dimensions")
    code = 0
    if frame.dtype is not None:
        if frame.dtype not in DTYPES:
            raise FrameError(f"dtype {frame.dtype!r} is not one of {sorted(DTYPES)}")
        code, size = DTYPES[frame.dtype]
        if math.prod(frame.shape) * size != len(frame.payload):
            raise FrameError(f"payload of {len(frame.payload)} bytes does not hold {frame.shape} x {frame.dtype}")
    head = HEADER.pack(MAGIC, FRAME_VERSION, frame.kind, code, frame.layer, len(frame.block_ids), len(rid),
                       len(frame.shape), len(frame.payload))
    return (head + rid + struct.pack(f"<{len(frame.block_ids)}i", *frame.block_ids)
            + struct.pack(f"<{len(frame.shape)}I", *frame.shape))


def encode(frame: Frame) -> bytes:
    return encode_header(frame) + bytes(frame.payload)


def send_frame(sock: socket.socket, frame: Frame) -> None:
    sock.sendall(encode_header(frame))
    if len(frame.payload):
        sock.sendall(frame.payload)


def _read_exactly(read_into, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = read_into(view[got:])
        if not k:
            raise FrameError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def read_frame(sock: socket.socket) -> Frame:
    """The next frame from `sock` (FrameError if it is not a valid one)."""
    return decode_from(sock.recv_into)


def decode(data: bytes) -> Frame:
    """One frame from bytes holding exactly it."""
    view = memoryview(data)
    pos = 0

    def read_into(buf: memoryview) -> int:
        nonlocal pos
        k = min(len(buf), len(view) - pos)
        buf[:k] = view[pos:pos + k]
        pos += k
        return k

    frame = decode_from(read_into)
    if pos != len(view):
        raise FrameError(f"{len(view) - pos} bytes after the frame")
    return frame


def decode_from(read_into) -> Frame:
    magic, version, kind, code, layer, nblocks, rid_len, ndim, nbytes = HEADER.unpack(
        _read_exactly(read_into, HEADER.size))
    if magic != MAGIC:
        raise FrameError(f"not a pagedserve KV frame (magic {bytes(magic)!r})")
    if version != FRAME_VERSION:
        raise FrameError(f"frame version {version}; this side speaks {FRAME_VERSION}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    if rid_len > MAX_REQUEST_ID_BYTES or nblocks > MAX_BLOCKS or ndim > MAX_NDIM or nbytes > MAX_PAYLOAD_BYTES:
        raise FrameError("frame header exceeds the limits")
    if code and code not in _DTYPE_NAMES:
        raise FrameError(f"unknown dtype code {code}")
    rest = _read_exactly(read_into, rid_len + 4 * nblocks + 4 * ndim)
    try:
        rid = rest[:rid_len].decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("request id is not UTF-8") from None
    block_ids = struct.unpack_from(f"<{nblocks}i", rest, rid_len)
    shape = struct.unpack_from(f"<{ndim}I", rest, rid_len + 4 * nblocks)
    dtype = _DTYPE_NAMES.get(code)
    if dtype is not None and math.prod(shape) * DTYPES[dtype][1] != nbytes:
        raise FrameError(f"payload of {nbytes} bytes does not hold {shape} x {dtype}")
    payload = _read_exactly(read_into, nbytes) if nbytes else bytearray()
    return Frame(kind, rid, layer, block_ids, dtype, shape, payload)
