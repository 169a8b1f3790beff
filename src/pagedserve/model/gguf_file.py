"""Read a GGUF file: its metadata as plain Python values and its tensors as float32 or
as the blocks they are stored in.

The `gguf` package does the parsing and dequantisation; this module turns its reader
objects into plain data the rest of pagedserve can use, and stands between it and a
malformed file. `read_tensors` reads the tensor table alone, walking the header with the
same checks (80 ms on SmolLM2's 49k-entry vocabulary, where the reader takes 2 s): a model
whose metadata is cached starts from the file's memory map. Either way, whatever is wrong
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
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFReader, GGUFValueType, GGMLQuantizationType
from gguf.quants import dequantize

# Types we promise to load (tests/test_gguf_types.py writes and reads each): the ones
# llama-quantize's presets put in files (Q4_K_M holds Q4_K, Q6_K and, for rows whose width
# is not a multiple of 256, Q5_0 or Q8_0).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K",
                 "Q5_K", "Q6_K")
)
# The smallest encodings of one metadata entry (key length, key, type, a 1-byte value)
# and of one tensor entry (name length, name, ndims, a dim, type, offset): a header
# claiming more entries than its file could hold is refused before any is parsed.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_MAX_DIMS = 4  # GGML_MAX_DIMS
# What the reader raises on bytes it cannot make sense of (it does not check much itself).
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error, UnicodeDecodeError)


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader can use; the message says why."""


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a plain value: str, int, float, bool or a list."""
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            # Decode in one pass; ReaderField.contents() is slow on 49k strings.
            parts = field.parts
            return [bytes(parts[i]).decode("utf-8", errors="replace") for i in field.data]
        values = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
        return values.tolist()
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    return value.item() if hasattr(value, "item") else value


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
        _check_header(self.path)
        try:
            self._reader = GGUFReader(self.path)
            self.metadata: dict[str, Any] = {
                key: _field_value(field)
                for key, field in self._reader.fields.items()
                if not key.startswith("GGUF.")
            }
            self._tensors = [self._tensor(t) for t in self._reader.tensors]
        except GGUFFormatError as e:
            raise GGUFFormatError(f"{self.path}: {e}") from None
        except _PARSE_ERRORS as e:
            raise GGUFFormatError(f"{self.path} is not a valid GGUF file: {type(e).__name__}: {e}") from None

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def tensors(self) -> list[GGUFTensor]:
        return list(self._tensors)

    @staticmethod
    def _tensor(t: Any) -> GGUFTensor:
        dims = [int(d) for d in t.shape]
        # The reader checks sizes and offsets against the file (a short view does not
        # reshape) but takes a zero dimension as an empty tensor.
        if not 1 <= len(dims) <= _MAX_DIMS or min(dims) < 1:
            raise GGUFFormatError(f"tensor {t.name!r} has dimensions {dims}")
        # GGUF lists dims fastest-first; reverse for row-major.
        return GGUFTensor(name=t.name, qtype=t.tensor_type, shape=tuple(reversed(dims)), raw=t.data)


_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


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

    def uint(self, fmt: str, what: str) -> int:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> None:
        self.skip(self.uint("Q", f"the length of {what}"), what)

    def read_string(self, what: str) -> bytes:
        return self.take(self.uint("Q", f"the length of {what}"), what)


def header_bytes(path: str | Path) -> int:
    """Where the header (metadata and tensor table) ends: everything a model's config,
    tokenizer and tensor layout come from."""
    return _check_header(Path(path))[2]


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor's name, type, shape and bytes (memory-mapped, read-only), from the header
    alone; GGUFFormatError if the table is malformed or a tensor runs past the file."""
    path = Path(path)
    alignment, infos, end = _check_header(path)
    data_start = -(-end // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{path}: tensor {name!r} has unknown GGML type {kind}") from None
        if min(dims) < 1 or dims[0] % block_values:
            raise GGUFFormatError(f"{path}: tensor {name!r} has dimensions {dims} (rows of whole "
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


def _check_header(path: Path) -> tuple[int, list[tuple[str, list[int], int, int]], int]:
    """Walk the header (magic, version, counts, every metadata entry and tensor entry)
    checking each length against the bytes left, before the reader trusts any of them.
    Returns the data alignment, each tensor's (name, dims fastest-first, type, offset) and
    where the header ends."""
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


def _check_entries(cursor: _Cursor, num_kv: int, num_tensors: int) -> tuple[int, list, int]:
    alignment = GGUF_DEFAULT_ALIGNMENT
    for index in range(num_kv):
        key, kind, value = _check_value(cursor, f"metadata entry {index}")
        if key == b"general.alignment":
            if kind != GGUFValueType.UINT32:
                raise GGUFFormatError("general.alignment is not a uint32")
            alignment = struct.unpack(cursor.order + "I", value)[0]
            if alignment < 1 or alignment & (alignment - 1):
                raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    infos = []
    for index in range(num_tensors):
        name = cursor.read_string(f"the name of tensor {index}").decode("utf-8", errors="replace")
        num_dims = cursor.uint("I", f"the dimension count of tensor {index}")
        if not 1 <= num_dims <= _MAX_DIMS:
            raise GGUFFormatError(f"tensor {index} has {num_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        fields = cursor.take(8 * num_dims + 4 + 8, f"the dimensions, type and offset of tensor {index}")
        *dims, kind, offset = struct.unpack(cursor.order + "Q" * num_dims + "IQ", fields)
        infos.append((name, dims, kind, offset))
    return alignment, infos, cursor.pos


def _check_value(cursor: _Cursor, what: str) -> tuple[bytes, int, bytes | None]:
    """Skips one metadata entry; returns its key, type and (for a scalar) value bytes."""
    key = cursor.read_string(f"the key of {what}")
    kind = cursor.uint("I", f"the type of {what}")
    value = None
    if kind == GGUFValueType.STRING:
        cursor.string(what)
    elif kind == GGUFValueType.ARRAY:
        item_kind = cursor.uint("I", f"the item type of {what}")
        count = cursor.uint("Q", f"the length of {what}")
        if item_kind == GGUFValueType.STRING:
            if count * 8 > len(cursor.data) - cursor.pos:
                raise GGUFFormatError(f"{what} claims {count} strings, more than the file can hold")
            for _ in range(count):
                cursor.string(f"a string of {what}")
        elif item_kind in _SCALAR_SIZES:
            cursor.skip(count * _SCALAR_SIZES[GGUFValueType(item_kind)], f"the {count} items of {what}")
        else:
            raise GGUFFormatError(f"{what} is an array of type {item_kind}, which this reader does not take")
    elif kind in _SCALAR_SIZES:
        value = cursor.take(_SCALAR_SIZES[GGUFValueType(kind)], what)
    else:
        raise GGUFFormatError(f"{what} has unknown type {kind}")
    return key, kind, value
