"""A chat request's images (docs/images.md): found in its messages, counted, refused for a
model without vision, loaded (data: URLs, or http(s) URLs through media_fetch.py),
decoded and bounded (multimodal/media.py), and their prompt tokens counted.

Chat, Messages and Responses requests all reach here as chat messages whose content
parts are `image_url`s (Anthropic's base64 sources become data: URLs). The checks run
cheapest first: the count (a prompt with 1,000 images is refused before one is
decoded), the model, then each image's bytes.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..multimodal.inputs import ImageInput
from ..multimodal.media import ImageLimits, decode_image, split_data_url
from .errors import APIError
from .media_fetch import DEFAULT_FETCH_TIMEOUT_S, FLAG, FetchPolicy, fetch
from .openai_bodies import ChatMessage, ImageURL, ImageURLPart

# Images one prompt may hold whatever --limit-mm-per-prompt says.
MAX_IMAGES_PER_PROMPT = 64
DEFAULT_IMAGES_PER_PROMPT = 8
LIMIT_FLAG = "--limit-mm-per-prompt"
MODALITIES = ("image",)


class Vision(Protocol):
    """What the serving code needs of a vision model (LLMEngine.vision)."""

    placeholder: str

    def tokens_per_image(self, image: ImageInput) -> int: ...


def parse_mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt as vLLM spells it: `image=4` (comma-separated pairs) or JSON `{"image": 4}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {e}") from None
    else:
        raw = {}
        for pair in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = pair.partition("=")
            if not sep or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"limit_mm_per_prompt takes modality=count pairs (image=4), got {pair!r}")
            raw[name.strip()] = int(value)
    if not isinstance(raw, dict):
        raise ValueError("limit_mm_per_prompt must be an object of modality -> count, e.g. {\"image\": 4}")
    return check_mm_limits(raw)


def check_mm_limits(limits: dict[str, object]) -> dict[str, int]:
    """The limits, each modality known and each count in [0, MAX_IMAGES_PER_PROMPT]."""
    for name, count in limits.items():
        if name not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: modality {name!r} is not supported (supported: "
                             f"{', '.join(MODALITIES)})")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_IMAGES_PER_PROMPT:
            raise ValueError(f"limit_mm_per_prompt: {name} must be an integer in [0, {MAX_IMAGES_PER_PROMPT}], "
                             f"got {count!r}")
    return dict(limits)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """The server's image flags: the per-prompt count, the hosts images are fetched from, the bounds."""

    max_images: int = DEFAULT_IMAGES_PER_PROMPT
    allowed_domains: frozenset[str] = frozenset()
    limits: ImageLimits = field(default_factory=ImageLimits)
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


def image_parts(messages: Sequence[ChatMessage]) -> list[ImageURL]:
    """The messages' images in prompt order; 400 past the hard maximum, before anything is decoded."""
    found = [part.image_url for m in messages if isinstance(m.content, list)
             for part in m.content if isinstance(part, ImageURLPart)]
    if len(found) > MAX_IMAGES_PER_PROMPT:
        raise APIError(400, f"the messages hold {len(found)} images; a prompt may hold at most "
                            f"{MAX_IMAGES_PER_PROMPT}", param="messages")
    return found


class ImageLoader:
    """One server's image handling: `vision` is the model's (None: it takes no images);
    `encode` tokenises text without special tokens (for the placeholder's own tokens)."""

    def __init__(self, policy: ImagePolicy, vision: Vision | None, encode: Callable[[str], list[int]]):
        self.policy = policy
        self.vision = vision
        self._fetch = FetchPolicy(policy.allowed_domains, policy.limits.max_bytes, policy.fetch_timeout_s)
        self._placeholder_tokens = len(encode(vision.placeholder)) if vision is not None else 0

    @property
    def placeholder(self) -> str | None:
        """What the chat template writes where an image goes (None: the model takes no images)."""
        return self.vision.placeholder if self.vision is not None else None

    def check(self, parts: Sequence[ImageURL], model: str) -> None:
        """The cheap checks, before any image is read: the model takes images, and not this many."""
        if parts and self.vision is None:
            raise APIError(400, f"the model {model!r} does not accept images", param="messages")
        if len(parts) > self.policy.max_images:
            raise APIError(400, f"the messages hold {len(parts)} images; this server takes at most "
                                f"{self.policy.max_images} per prompt ({LIMIT_FLAG})", param="messages")

    def load(self, parts: Sequence[ImageURL]) -> list[ImageInput]:
        """Each image read and decoded (blocking: fetches and decoding run in the thread pool)."""
        return [self._load(part, i, len(parts)) for i, part in enumerate(parts)]

    def _load(self, part: ImageURL, index: int, count: int) -> ImageInput:
        try:
            if part.url[:5].lower() == "data:":
                media_type, data = split_data_url(part.url, self.policy.limits)
            elif part.url.split(":", 1)[0].lower() in ("http", "https"):
                data, media_type = fetch(part.url, self._fetch)
            else:
                raise ValueError(f"an image URL must be a data: URL or an http(s) URL on a host {FLAG} lists")
            return decode_image(data, media_type, self.policy.limits)
        except ValueError as e:
            raise APIError(400, f"image {index + 1} of {count}: {e}", param="messages") from None

    def prompt_tokens(self, text: str, token_ids: Sequence[int], images: Sequence[ImageInput]) -> int:
        """The prompt's length once each image's placeholder is its tokens; 400 when the
        rendered text holds the placeholder other than once per image (a message's own
        text must not pose as an image)."""
        if self.vision is None:
            return len(token_ids)
        written = text.count(self.vision.placeholder)
        if written != len(images):
            raise APIError(400, f"the prompt holds the image placeholder {self.vision.placeholder!r} {written} "
                                f"times for {len(images)} images (message text may not contain it)",
                           param="messages")
        image_tokens = sum(self.vision.tokens_per_image(image) for image in images)
        return len(token_ids) - len(images) * self._placeholder_tokens + image_tokens
