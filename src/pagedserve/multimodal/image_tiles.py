"""Idefics3's image preprocessing (transformers' Idefics3ImageProcessorPil, the same
arithmetic step for step): resize the longest edge, resize up to whole tiles, cut the
tiles row by row and add the whole image resized to one tile (the global image), then
rescale and normalise. Pillow does the resizing, as transformers does without torchvision.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .inputs import ImageInput

# transformers' MAX_IMAGE_SIZE: no edge is resized above it.
_MAX_EDGE = 4096
_PREPROCESSOR_FILE = "preprocessor_config.json"
_PROCESSOR_FILE = "processor_config.json"


@dataclass(frozen=True)
class TiledImage:
    pixel_values: np.ndarray  # float32 [tiles, 3, S, S]: rows x cols tiles, then the global image
    rows: int  # 0 and 0: not split, one tile
    cols: int


@dataclass(frozen=True)
class ImageTiling:
    longest_edge: int | None  # the first resize (None: do_resize off)
    tile_size: int  # max_image_size.longest_edge
    split: bool  # do_image_splitting
    resample: int  # a PIL resampling filter (LANCZOS by default)
    rescale_factor: float | None  # None: do_rescale off
    mean: tuple[float, float, float] | None  # None: do_normalize off
    std: tuple[float, float, float] | None

    @classmethod
    def from_folder(cls, folder: Path) -> "ImageTiling":
        """preprocessor_config.json's settings, or those under processor_config.json's
        "image_processor" (where transformers 5 writes them)."""
        path = folder / _PREPROCESSOR_FILE
        if path.is_file():
            return cls.from_dict(json.loads(path.read_text()), str(path))
        path = folder / _PROCESSOR_FILE
        cfg = json.loads(path.read_text()).get("image_processor") if path.is_file() else None
        if not isinstance(cfg, dict):
            raise ValueError(f"{folder} holds a vision model but no image processor settings "
                             f"({_PREPROCESSOR_FILE}, or {_PROCESSOR_FILE} with an image_processor)")
        return cls.from_dict(cfg, str(path))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], what: str) -> "ImageTiling":
        # Sizes given another way (height and width) would resize differently: refused, not defaulted.
        for key in ("size", "max_image_size"):
            if key in cfg and "longest_edge" not in (cfg[key] or {}):
                raise ValueError(f"{what}: {key} {cfg[key]!r} is not implemented (only a longest_edge)")
        try:
            return cls(
                longest_edge=int(cfg.get("size", {}).get("longest_edge", 4 * 364)) if cfg.get("do_resize", True) else None,
                tile_size=int(cfg.get("max_image_size", {}).get("longest_edge", 364)),
                split=bool(cfg.get("do_image_splitting", True)),
                resample=int(cfg.get("resample", Image.Resampling.LANCZOS)),
                rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
                mean=tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))) if cfg.get("do_normalize", True) else None,
                std=tuple(cfg.get("image_std", (0.5, 0.5, 0.5))) if cfg.get("do_normalize", True) else None,
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{what}: {e}") from None

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the longest-edge resize (transformers' two size rules)."""
        if self.longest_edge is None:
            return height, width
        aspect = width / height
        if width >= height:
            width = self.longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = self.longest_edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > _MAX_EDGE:
            width, height = _MAX_EDGE, int(_MAX_EDGE / aspect)
        elif height > width and height > _MAX_EDGE:
            height, width = _MAX_EDGE, int(_MAX_EDGE * aspect)
        return max(height, 1), max(width, 1)

    def tiled_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the resized image grown to whole tiles (splitting on)."""
        t = self.tile_size
        aspect = width / height
        if width >= height:
            width = math.ceil(width / t) * t
            height = math.ceil(int(width / aspect) / t) * t
        else:
            height = math.ceil(height / t) * t
            width = math.ceil(int(height * aspect) / t) * t
        return height, width

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles an image of this size is cut into; (0, 0): one tile."""
        if not self.split:
            return 0, 0
        h, w = self.tiled_size(*self.resized_size(height, width))
        t = self.tile_size
        return (h // t, w // t) if h > t or w > t else (0, 0)

    def tile(self, image: ImageInput) -> TiledImage:
        pixels = image.pixels
        if self.longest_edge is not None:
            pixels = _resize(pixels, *self.resized_size(*pixels.shape[:2]), self.resample)
        t, rows, cols = self.tile_size, 0, 0
        if self.split:
            pixels = _resize(pixels, *self.tiled_size(*pixels.shape[:2]), self.resample)
            rows, cols = pixels.shape[0] // t, pixels.shape[1] // t
            if pixels.shape[0] > t or pixels.shape[1] > t:
                tiles = [pixels[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
                tiles.append(_resize(pixels, t, t, self.resample))
            else:
                rows = cols = 0
                tiles = [pixels]
        else:
            tiles = [_resize(pixels, t, t, self.resample)]
        return TiledImage(np.stack([self._normalise(x) for x in tiles]), rows, cols)

    def _normalise(self, tile: np.ndarray) -> np.ndarray:
        """uint8 [H, W, 3] -> float32 [3, H, W], in transformers' order of casts."""
        x = tile.transpose(2, 0, 1)
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32) if self.rescale_factor is not None \
            else x.astype(np.float32)
        if self.mean is not None:
            mean, std = np.array(self.mean, dtype=np.float32), np.array(self.std, dtype=np.float32)
            x = ((x.T - mean) / std).T
        return np.ascontiguousarray(x, dtype=np.float32)


def _resize(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    if pixels.shape[:2] == (height, width):
        # transformers resizes even to the same size; Pillow returns a copy then, unchanged.
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample=resample))
