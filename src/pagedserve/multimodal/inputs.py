"""The one shape an image has between the API layer and the engine.

The HTTP layer decodes and bounds what a client sent (data: URLs, base64 blocks, allowed
URLs) into `ImageInput`s; the engine takes them beside a prompt whose text holds the
model's image placeholder once per image, in order. Keeping the pixels already decoded
(RGB, uint8) means the engine never parses untrusted bytes, and the content hash is
computed once, here, for the encoder cache and the prefix-cache keys.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One decoded image: `pixels` is uint8 [height, width, 3] RGB; `content_hash` is
    the sha256 (hex) of its shape and pixels, so two encodings of the same picture (PNG
    and JPEG of identical pixels, or two data: URLs) share encoder-cache and prefix-cache
    entries, and any pixel change does not."""

    pixels: np.ndarray
    content_hash: str

    @classmethod
    def from_array(cls, pixels: np.ndarray) -> "ImageInput":
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"image pixels must be uint8 [height, width, 3], got {pixels.dtype} {list(pixels.shape)}")
        if pixels.shape[0] < 1 or pixels.shape[1] < 1:
            raise ValueError(f"image must be at least 1x1 pixels, got {pixels.shape[1]}x{pixels.shape[0]}")
        pixels = np.ascontiguousarray(pixels)
        digest = hashlib.sha256(repr(pixels.shape).encode())
        digest.update(pixels.tobytes())
        return cls(pixels=pixels, content_hash=digest.hexdigest())

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), PIL's order."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])
