"""Idefics3's prompt side: each `<image>` placeholder of a prompt becomes the token run
transformers' Idefics3Processor writes for that image (per tile `<fake_token_around_image>`,
`<row_r_col_c>` and image_seq_len `<image>` tokens, rows ended by a newline, then the
global image's `<fake_token_around_image><global-img>`, its `<image>` tokens and a closing
`<fake_token_around_image>`), with the position of each image's run.

Expanding token ids, not text: the run begins and ends with special tokens, so a tokenizer
splits there and the ids equal those of the expanded text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .image_tiles import ImageTiling
from .inputs import ImageInput

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


@dataclass(frozen=True)
class ExpandedPrompt:
    token_ids: list[int]
    spans: list[tuple[int, int]]  # (offset, length) of each image's run, in order
    pixel_values: list[np.ndarray]  # each image's tiles, float32 [tiles, 3, S, S]


def image_run_text(rows: int, cols: int, image_seq_len: int) -> str:
    """transformers' Idefics3Processor.replace_image_token, for one image's grid."""
    tokens = IMAGE_TOKEN * image_seq_len
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tokens}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return whole
    text = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{text}\n{whole}"


class Idefics3Prompts:
    """`placeholder` and `tokens_per_image` are the engine's `vision` (LLMEngine.vision)."""

    placeholder = IMAGE_TOKEN

    def __init__(self, tiling: ImageTiling, image_seq_len: int, image_token_id: int,
                 encode: Callable[[str], list[int]], token_to_id: Callable[[str], int | None]):
        """`encode`: the model's tokenizer without BOS/EOS; `token_to_id`: its vocabulary."""
        for token in (IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN):
            if token_to_id(token) is None:
                raise ValueError(f"the tokenizer of an idefics3 model has no {token} token")
        if token_to_id(IMAGE_TOKEN) != image_token_id:
            raise ValueError(f"the tokenizer's {IMAGE_TOKEN} is id {token_to_id(IMAGE_TOKEN)}, but the model's "
                             f"image_token_id is {image_token_id}")
        self.tiling, self.image_seq_len, self.image_token_id = tiling, image_seq_len, image_token_id
        self._run_ids = lru_cache(maxsize=None)(lambda rows, cols: tuple(encode(image_run_text(rows, cols,
                                                                                            image_seq_len))))

    def tokens_per_image(self, image: ImageInput) -> int:
        return len(self._run_ids(*self.tiling.grid(*image.size)))

    def expand(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
        """Each placeholder id replaced by its image's run; ValueError naming `images` when
        their counts differ."""
        at = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ValueError(f"images: {len(images)} given, but the prompt has {len(at)} {IMAGE_TOKEN} "
                             "placeholders (one per image, in order)")
        out: list[int] = []
        spans, pixels, last = [], [], 0
        for i, image in zip(at, images):
            tiled = self.tiling.tile(image)
            run = self._run_ids(tiled.rows, tiled.cols)
            out.extend(token_ids[last:i])
            spans.append((len(out), len(run)))
            out.extend(run)
            pixels.append(tiled.pixel_values)
            last = i + 1
        out.extend(token_ids[last:])
        return ExpandedPrompt(out, spans, pixels)
