"""The image rows of a step: which rows of the flattened batch are image tokens, and the
vision encoder's output for them.

An image is encoded whole, once: its output ([image tokens, hidden]) is kept in an
`EncoderCache` under its content hash, and each prefill chunk takes the slice for the
image tokens it covers (chunked prefill may cut through an image's run). The cache is
bounded (least recently used out); a preempted request, a repeated image or a chunk
after the first finds the output there, and one evicted is recomputed from the pixels,
which the engine registers with a request and releases when it ends.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.scheduler_output import ScheduledRequest

# Images whose encoder output is kept (SmolVLM's largest image, 17 tiles of 64 tokens at
# hidden 576 in fp32, is 2.5 MB).
DEFAULT_ENCODER_CACHE_IMAGES = 64


class EncoderCache:
    """Encoder outputs by content hash, at most `capacity` of them."""

    def __init__(self, capacity: int = DEFAULT_ENCODER_CACHE_IMAGES):
        if capacity < 1:
            raise ValueError(f"encoder cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_encode(self, content_hash: str, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self._entries.get(content_hash)
        if found is not None:
            self.hits += 1
            self._entries.move_to_end(content_hash)
            return found
        self.misses += 1
        out = self._entries[content_hash] = encode()
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return out


@dataclass(frozen=True)
class ImageRows:
    rows: torch.Tensor  # [K] int64: rows of the step's flattened batch that are image tokens
    embeds: torch.Tensor  # [K, hidden]: what those rows take instead of their token embedding


class ImageEmbedder:
    """Owns the pixels of the requests in flight and the encoder cache."""

    def __init__(self, encoder: torch.nn.Module, image_token_id: int, cache: EncoderCache | None = None):
        self.encoder, self.image_token_id = encoder, image_token_id
        self.cache = cache or EncoderCache()
        self._pixels: dict[str, np.ndarray] = {}
        self._users: dict[str, set[str]] = {}  # content hash -> ids of the requests that hold it

    def register(self, request_id: str, images: Sequence[tuple[str, np.ndarray]]) -> None:
        """Keep each (content hash, tiles) until every request holding it is released."""
        for content_hash, pixels in images:
            self._pixels.setdefault(content_hash, pixels)
            self._users.setdefault(content_hash, set()).add(request_id)

    def release(self, request_id: str) -> None:
        for content_hash in [h for h, users in self._users.items() if request_id in users]:
            users = self._users[content_hash]
            users.discard(request_id)
            if not users:
                del self._users[content_hash], self._pixels[content_hash]

    @property
    def num_held(self) -> int:
        """Images whose pixels are held (0 once every request with images has ended)."""
        return len(self._pixels)

    def step_rows(self, sched: Sequence[ScheduledRequest], first_rows: np.ndarray) -> ImageRows | None:
        """The image rows of a step whose row i starts at flattened row first_rows[i]; None
        when no row computes an image token."""
        rows: list[np.ndarray] = []
        embeds: list[torch.Tensor] = []
        for s, first in zip(sched, first_rows.tolist()):
            start, end = s.start, s.start + s.num_new_tokens
            for span in s.request.images:
                lo, hi = max(start, span.offset), min(end, span.offset + span.length)
                if lo >= hi:
                    continue
                ids = np.asarray(s.request.all_token_ids[span.offset:span.offset + span.length])
                is_image = ids == self.image_token_id
                rank = np.cumsum(is_image) - 1  # each image token's row of the encoder output
                at = np.flatnonzero(is_image[lo - span.offset:hi - span.offset]) + (lo - span.offset)
                if not len(at):
                    continue
                out = self.cache.get_or_encode(span.content_hash, lambda h=span.content_hash: self._encode(h))
                rows.append(at + span.offset - start + first)
                embeds.append(out[torch.from_numpy(rank[at]).to(out.device)])
        if not rows:
            return None
        return ImageRows(torch.from_numpy(np.concatenate(rows)), torch.cat(embeds))

    def _encode(self, content_hash: str) -> torch.Tensor:
        pixels = self._pixels.get(content_hash)
        if pixels is None:
            raise RuntimeError(f"image {content_hash[:12]}... is scheduled but its pixels were released")
        return self.encoder(torch.from_numpy(pixels))
