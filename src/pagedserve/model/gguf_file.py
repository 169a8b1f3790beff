"""Read a GGUF file: its metadata as plain Python values and its tensors as float32 or
as the blocks they are stored in.

The header (metadata and tensor table) is walked here, every length checked against the
bytes left before it is trusted; the `gguf` package dequantises. The walk decodes the
metadata as it goes (~0.1 s on SmolLM2's 49k-entry vocabulary, where gguf's reader takes
2 s: a GGUF's first load and every test file), and `read_tensors` reads the tensor table
alone. Whatever is wrong
(truncation, bad magic or version, absurd counts, dimensions or offsets, unknown types,
bad strings, non-finite weights), the caller
gets a `ValueError` naming the file and the problem, in time and memory bounded by the
file's size (tests/test_model_file_fuzz.py).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType, GGMLQuantizationType
from gguf.quants import dequantize

# Types we promise to load (tests/test_gguf_types.py writes and reads each): the ones
# llama-quantize's presets put in files (Q4_K_M holds Q4_K, Q6_K and, for rows whose width
# is not a multiple of 256, Q5_0 or Q8_0; Q2_K / Q3_K / IQ4_XS fall back to IQ4_NL there), and
# MXFP4, gpt-oss's experts.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)
# The smallest encodings of one metadata entry (key length, key, type, a 1-byte value)
# and of one tensor entry (name length, name, ndims, a dim, type, offset): a header
# claiming more entries than its file could hold is refused before any is parsed.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader can use; the message says why."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch order (rows first), as the model uses it
    raw: np.ndarray  # the bytes or values as stored, memory-mapped

    def to_float32(self) -> np.ndarray:
        if self.qtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"tensor {self.name!r} has GGUF type {self.qtype.name}; supported: "
                + ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            )
        out = dequantize(self.raw, self.qtype)
        # A copy: F32 tensors would otherwise alias the read-only memory map.
        values = np.array(out.reshape(self.shape), dtype=np.float32)
        if not np.isfinite(values).all():
            bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
            raise GGUFFormatError(f"tensor {self.name!r} holds {bad} NaN or infinite values")
        return values


class GGUFFile:
    """Metadata and tensors of one GGUF file, read once; GGUFFormatError if it is malformed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header = _check_header(self.path)
        self.metadata: dict[str, Any] = header.metadata
        self.header_end = header.end  # header_bytes(path), without a second walk
        self._tensors = _map_tensors(self.path, header)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def tensors(self) -> list[GGUFTensor]:
        return list(self._tensors)


# Each scalar type's struct / numpy format character.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.BOOL: "?", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class _Header:
    alignment: int
    infos: list[tuple[str, list[int], int, int]]  # each tensor's name, dims fastest-first, type, offset
    end: int  # where the header ends
    metadata: dict[str, Any]  # every entry as a plain value: str, int, float, bool or a list


class _Cursor:
    """Reads the header's little- or big-endian fields, refusing any length that runs
    past the end of the file (the reader would loop over it item by item)."""

    def __init__(self, data: memoryview, order: str, pos: int):
        self.data, self.order, self.pos = data, order, pos

    def skip(self, size: int, what: str) -> None:
        if size > len(self.data) - self.pos:
            raise GGUFFormatError(f"{what} at byte {self.pos} needs {size} bytes; the file ends at {len(self.data)}")
        self.pos += size

    def take(self, size: int, what: str) -> bytes:
        """A copy, so that no view of the map outlives the walk (an error's traceback would
        hold it, and the map could not close)."""
        self.skip(size, what)
        return bytes(self.data[self.pos - size:self.pos])

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def read_string(self, what: str) -> bytes:
        return self.take(self.unpack("Q", f"the length of {what}"), what)


def header_bytes(path: str | Path) -> int:
    """Where the header (metadata and tensor table) ends: everything a model's config,
    tokenizer and tensor layout come from."""
    return _check_header(Path(path)).end


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor's name, type, shape and bytes (memory-mapped, read-only), from the header
    alone; GGUFFormatError if the table is malformed or a tensor runs past the file."""
    path = Path(path)
    return _map_tensors(path, _check_header(path))


def _map_tensors(path: Path, header: _Header) -> list[GGUFTensor]:
    alignment = header.alignment
    data_start = -(-header.end // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, dims, kind, offset in header.infos:
        try:
            qtype = GGMLQuantizationType(kind)
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{path}: tensor {name!r} has unknown GGML type {kind}") from None
        if min(dims) < 1 or dims[0] % block_values:
            raise GGUFFormatError(f"{path}: tensor {name!r} ({qtype.name}) has dimensions {dims} (rows of whole "
                                  f"{block_values}-value blocks needed)")
        nbytes = int(np.prod(dims, dtype=np.int64)) // block_values * block_bytes
        start = data_start + offset
        if offset % alignment or start + nbytes > mapped.size:
            raise GGUFFormatError(f"{path}: tensor {name!r} at offset {offset} ({nbytes} bytes) runs past the "
                                  f"file's {mapped.size} bytes or is misaligned")
        shape = tuple(reversed(dims))
        raw = mapped[start:start + nbytes]
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):  # as GGUFReader gives them
            raw = raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16).reshape(shape)
        else:
            raw = raw.reshape(*shape[:-1], dims[0] // block_values * block_bytes)
        tensors.append(GGUFTensor(name=name, qtype=qtype, shape=shape, raw=raw))
    return tensors


def _check_header(path: Path) -> _Header:
    """Walk the header (magic, version, counts, every metadata entry and tensor entry)
    checking each length against the bytes left before reading what it covers."""
    size = path.stat().st_size
    if size < 24:
        raise GGUFFormatError(f"{path} is {size} bytes long, too short for a GGUF header")
    with path.open("rb") as f:
        head = f.read(24)
    magic, version = struct.unpack("<II", head[:8])
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    order = ">" if version & 0xFFFF == 0 else "<"  # written big-endian: the reader handles both
    version, num_tensors, num_kv = struct.unpack(order + "IQQ", head[4:])
    if version not in (2, 3):
        raise GGUFFormatError(f"{path} is GGUF version {version}; this reader takes versions 2 and 3")
    room = size - 24
    if num_kv * _MIN_KV_BYTES > room or num_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise GGUFFormatError(f"{path} claims {num_kv} metadata entries and {num_tensors} tensors, more than its "
                              f"{size} bytes can hold")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _check_entries(_Cursor(view, order, 24), num_kv, num_tensors)
        except GGUFFormatError as e:
            raise GGUFFormatError(f"{path}: {e}") from None
        finally:
            view.release()


def _check_entries(cursor: _Cursor, num_kv: int, num_tensors: int) -> _Header:
    alignment = GGUF_DEFAULT_ALIGNMENT
    metadata = {}
    for index in range(num_kv):
        key, kind, value = _check_value(cursor, f"metadata entry {index}")
        metadata[key] = value
        if key == "general.alignment":
            if kind != GGUFValueType.UINT32:
                raise GGUFFormatError("general.alignment is not a uint32")
            alignment = value
            if alignment < 1 or alignment & (alignment - 1):
                raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    infos = []
    for index in range(num_tensors):
        name = cursor.read_string(f"the name of tensor {index}").decode("utf-8", errors="replace")
        num_dims = cursor.unpack("I", f"the dimension count of tensor {index}")
        if not 1 <= num_dims <= _MAX_DIMS:
            raise GGUFFormatError(f"tensor {index} has {num_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        fields = cursor.take(8 * num_dims + 4 + 8, f"the dimensions, type and offset of tensor {index}")
        *dims, kind, offset = struct.unpack(cursor.order + "Q" * num_dims + "IQ", fields)
        infos.append((name, dims, kind, offset))
    return _Header(alignment, infos, cursor.pos, metadata)


def _read_strings(cursor: _Cursor, count: int, what: str) -> list[str]:
    """An array of `count` strings (a vocabulary: ~50-250k), each length checked as
    _Cursor checks it; read in place, one unpack and one decode each, since a method call
    and a copy per field made this most of a load's header time. A vocabulary's odd token is
    kept, not refused (gguf's reader replaces it too)."""
    data, pos, end = cursor.data, cursor.pos, len(cursor.data)
    length = struct.Struct(cursor.order + "Q").unpack_from
    out = []
    for _ in range(count):
        if end - pos < 8:
            raise GGUFFormatError(f"the length of a string of {what} at byte {pos} needs 8 bytes; the file ends at {end}")
        (size,) = length(data, pos)
        pos += 8
        if size > end - pos:
            raise GGUFFormatError(f"a string of {what} at byte {pos} needs {size} bytes; the file ends at {end}")
        out.append(str(data[pos:pos + size], "utf-8", errors="replace"))
        pos += size
    cursor.pos = pos
    return out


def _check_value(cursor: _Cursor, what: str) -> tuple[str, int, Any]:
    """Reads one metadata entry: its key, type and value."""
    key = _decode(cursor.read_string(f"the key of {what}"), f"the key of {what}")
    kind = cursor.unpack("I", f"the type of {what}")
    if kind == GGUFValueType.STRING:
        return key, kind, _decode(cursor.read_string(what), what)
    if kind == GGUFValueType.ARRAY:
        item_kind = cursor.unpack("I", f"the item type of {what}")
        count = cursor.unpack("Q", f"the length of {what}")
        if item_kind == GGUFValueType.STRING:
            if count * 8 > len(cursor.data) - cursor.pos:
                raise GGUFFormatError(f"{what} claims {count} strings, more than the file can hold")
            return key, kind, _read_strings(cursor, count, what)
        if item_kind in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[GGUFValueType(item_kind)]
            raw = cursor.take(count * struct.calcsize(fmt), f"the {count} items of {what}")
            return key, kind, np.frombuffer(raw, dtype=np.dtype(cursor.order + fmt)).tolist()
        raise GGUFFormatError(f"{what} is an array of type {item_kind}, which this reader does not take")
    if kind in _SCALAR_FORMATS:
        return key, kind, cursor.unpack(_SCALAR_FORMATS[GGUFValueType(kind)], what)
    raise GGUFFormatError(f"{what} has unknown type {kind}")


def _decode(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise GGUFFormatError(f"{what} is not UTF-8") from None
