"""Untrusted image bytes -> a bounded, decoded `ImageInput` (docs/images.md).

Every check that bounds time and memory runs before the pixels are decoded:
- the encoded size (a data: URL's base64 text is measured before it is decoded);
- the format: Pillow opens only the allow-listed formats, and the format it detects
  must be the one the client declared (a data: URL's or Anthropic's media type, an
  HTTP Content-Type), so a polyglot file is read as what it says it is or refused;
- the pixel count, read from the header: a decompression bomb is refused before a
  single row is inflated (Pillow's own bomb check, which fires at twice its global
  `Image.MAX_IMAGE_PIXELS`, is reported with this module's limit).
Truncated files are refused (this module never turns on Pillow's process-wide
`ImageFile.LOAD_TRUNCATED_IMAGES`, and refuses to decode while anything else has).
An animated image (GIF, WebP, APNG) is its first frame. Every mode becomes 8-bit RGB:
alpha is composited on white; 16-bit and 32-bit grey keep their top 8 bits; CMYK,
palette, YCbCr and the rest go through Pillow's own conversion.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from .inputs import ImageInput

# Pillow's format name for each accepted media type (image/jpg is a common misspelling).
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF", "image/bmp": "BMP"}
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Pillow names a JPEG with several pictures (phone cameras write them) MPO; it is a JPEG.
_FORMAT_FAMILY = {"MPO": "JPEG"}
# 25 megapixels (a 6000x4000 photo): at most 75 MB of RGB pixels per image.
DEFAULT_MAX_PIXELS = 25_000_000
# Encoded bytes of one image, before decoding (a data: URL's base64 text is 4/3 of this).
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.IGNORECASE)
_WHITE = (255, 255, 255)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one image may cost: `max_pixels` (width x height) and `max_bytes` encoded."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        if self.max_pixels < 1 or self.max_bytes < 1:
            raise ValueError(f"image limits must be >= 1, got max_pixels={self.max_pixels}, "
                             f"max_bytes={self.max_bytes}")

    @property
    def max_base64_chars(self) -> int:
        """The longest base64 text whose bytes can fit `max_bytes`."""
        return 4 * ((self.max_bytes + 2) // 3)


def format_of(media_type: str) -> str:
    """Pillow's format name for an accepted media type; ValueError naming the accepted ones."""
    name = media_type.strip().lower()
    if name not in MEDIA_TYPES:
        accepted = ", ".join(t for t in MEDIA_TYPES if t != "image/jpg")
        raise ValueError(f"media type {media_type!r} is not accepted (accepted: {accepted})")
    return MEDIA_TYPES[name]


def split_data_url(url: str, limits: ImageLimits) -> tuple[str, bytes]:
    """A base64 `data:` URL's (media type, bytes); the text's size is checked before decoding."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ValueError("a data: URL must look like data:<media type>;base64,<data>")
    if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise ValueError("a data: URL must be base64-encoded (data:<media type>;base64,<data>)")
    # Measured before it is sliced out: refusing a huge URL copies none of it.
    _check_base64_length(len(url) - match.end(), limits)
    return match["type"], _decode_base64(url[match.end():], limits)


def _check_base64_length(length: int, limits: ImageLimits) -> None:
    if length > limits.max_base64_chars:
        raise ValueError(f"the image's base64 data is {length} characters, over the limit of "
                         f"{limits.max_base64_chars} ({limits.max_bytes} bytes)")


def _decode_base64(text: str, limits: ImageLimits) -> bytes:
    """Base64 image data (standard alphabet, padded), refused by its length before decoding."""
    _check_base64_length(len(text), limits)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image data is not valid base64") from None


def decode_image(data: bytes, media_type: str | None, limits: ImageLimits) -> ImageInput:
    """`data` decoded to RGB pixels; `media_type` (None: not declared) must match what the
    bytes are. Every refusal is a ValueError that says which limit or rule it broke."""
    if len(data) > limits.max_bytes:
        raise ValueError(f"the image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    declared = format_of(media_type) if media_type is not None else None
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # A process-wide switch something else turned on: decoding now would accept cut-off files.
        raise ValueError("image decoding is disabled while PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on")
    image = _open(data, limits)
    if declared is not None and _FORMAT_FAMILY.get(image.format, image.format) != declared:
        raise ValueError(f"the image is {image.format} data but was declared {media_type!r}")
    try:
        image.load()  # the first frame only: later frames of an animation are never decoded
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ValueError(f"the {image.format} image is truncated or corrupt: {e}") from None
    return ImageInput.from_array(to_rgb(image))


def _open(data: bytes, limits: ImageLimits) -> ImageFile.ImageFile:
    """The image's header read (nothing decoded yet), its size checked against the limit."""
    try:
        with warnings.catch_warnings():
            # Between Pillow's limit and twice it, Pillow only warns; the check below decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError:
        raise ValueError(f"the image has more pixels than the limit of {limits.max_pixels}") from None
    except UnidentifiedImageError:
        raise ValueError(f"the data is not an image in an accepted format ({', '.join(ALLOWED_FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ValueError(f"the image header cannot be read: {e}") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{limits.max_pixels}")
    if width < 1 or height < 1:
        raise ValueError(f"the image is {width}x{height} pixels: it has none")
    return image


def to_rgb(image: Image.Image) -> np.ndarray:
    """uint8 [height, width, 3]: alpha composited on white, 16/32-bit grey -> its top 8 bits,
    every other mode by Pillow's conversion (CMYK, palette, YCbCr, 1-bit, grey)."""
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        grey = np.asarray(image).astype(np.int64)
        # 16-bit files load as I;16 or I; both hold 0..65535 (a 32-bit I is clipped to that).
        grey = (np.clip(grey, 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode == "F":
        grey = np.clip(np.nan_to_num(np.asarray(image)), 0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*_WHITE, 255))
        image = Image.alpha_composite(background, rgba)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)
