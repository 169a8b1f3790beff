"""One disk-tier block file: a fixed header, every layer's K and V of one block, a checksum.

    magic      4s   b"PSKD"
    version    u16  FILE_VERSION (another version reads as corrupt: a miss)
    dtype      u8   element type (frame.DTYPES' codes)
    (pad)      1
    layers     u32  how many layers follow
    layer_len  u32  bytes of one layer's K and V of the block
    namespace  16s  the engine's namespace (core/kv_disk_index.py), raw
    hash       32s  the block's chain hash
    nbytes     u64  payload bytes = layers x layer_len
    payload    nbytes, layer by layer, each KVTensorLayout.blocks_shape(1) in C order
    crc32      u32  over header and payload

A reader checks every field against what it expects and the checksum over all of it, so a
torn file (a writer killed mid-way), a flipped bit or another engine's block is refused
(CorruptBlockFile), never served. Publication is atomic: the bytes go to a temp file in the
same directory, are fsynced, then renamed over the name; a crash leaves at worst a temp
file, which the index's rebuild deletes. The directory itself is not fsynced: after a power
loss a just-renamed file may be missing, which is a miss.
"""
from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import dataclass

from ..core.kv_disk_index import TEMP_PREFIX

MAGIC = b"PSKD"
FILE_VERSION = 1
HEADER = struct.Struct("<4sHBxII16s32sQ")
CRC = struct.Struct("<I")


class CorruptBlockFile(ValueError):
    """A block file that is cut short, damaged, of another version or for another block."""


@dataclass(frozen=True, slots=True)
class BlockFileShape:
    """What every file of one engine's namespace holds."""

    namespace: bytes  # 16 raw bytes
    dtype_code: int
    num_layers: int
    layer_bytes: int

    @property
    def file_bytes(self) -> int:
        return HEADER.size + self.num_layers * self.layer_bytes + CRC.size

    def header(self, block_hash: bytes) -> bytes:
        return HEADER.pack(MAGIC, FILE_VERSION, self.dtype_code, self.num_layers, self.layer_bytes,
                           self.namespace, block_hash, self.num_layers * self.layer_bytes)


def write_block_file(path: str, shape: BlockFileShape, block_hash: bytes, payload: bytes) -> None:
    """Publish `payload` at `path` atomically; OSError (the disk full, the directory gone or
    read-only) leaves no file behind."""
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{name}")
    header = shape.header(block_hash)
    crc = zlib.crc32(payload, zlib.crc32(header))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for part in (header, payload, CRC.pack(crc)):
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def read_block_file(path: str, shape: BlockFileShape, block_hash: bytes) -> memoryview:
    """The payload of the file at `path`; CorruptBlockFile unless every field and the checksum
    match; OSError if it cannot be read (gone: FileNotFoundError)."""
    data = bytearray(shape.file_bytes)  # writable: the payload becomes a tensor without a copy
    with open(path, "rb") as f:
        num_read = f.readinto(data)
        longer = f.read(1)
    if num_read != len(data) or longer:
        raise CorruptBlockFile(f"{num_read}{'+' if longer else ''} bytes, expected {shape.file_bytes}")
    view = memoryview(data)
    body = view[:-CRC.size]
    if HEADER.unpack_from(data) != HEADER.unpack(shape.header(block_hash)):
        raise CorruptBlockFile("the header names another block, engine or version")
    if zlib.crc32(body) != CRC.unpack_from(data, len(body))[0]:
        raise CorruptBlockFile("checksum mismatch")
    return body[HEADER.size:]
