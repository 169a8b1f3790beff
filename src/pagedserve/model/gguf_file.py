"""Read a GGUF file: its metadata as plain Python values and its tensors as float32.

The `gguf` package does the parsing and dequantisation; this module only turns
its reader objects into plain data the rest of pagedserve can use.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGMLQuantizationType
from gguf.quants import dequantize

# Types we promise to load (the tests build one block of each by hand).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)


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
        return np.array(out.reshape(self.shape), dtype=np.float32)


class GGUFFile:
    """Metadata and tensors of one GGUF file, read once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reader = GGUFReader(self.path)
        self.metadata: dict[str, Any] = {
            key: _field_value(field)
            for key, field in self._reader.fields.items()
            if not key.startswith("GGUF.")
        }

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def tensors(self) -> list[GGUFTensor]:
        return [
            GGUFTensor(
                name=t.name,
                qtype=t.tensor_type,
                # GGUF lists dims fastest-first; reverse for row-major.
                shape=tuple(int(d) for d in reversed(t.shape)),
                raw=t.data,
            )
            for t in self._reader.tensors
        ]
