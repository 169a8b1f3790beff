"""Images from untrusted bytes (multimodal/media.py), allow-listed fetches (http/media_fetch.py)
and a chat request's images (http/chat_images.py): every bad input a clear refusal, every
accepted mode a documented conversion to RGB."""
from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from pagedserve.http.chat_images import MAX_IMAGES_PER_PROMPT, ImageLoader, ImagePolicy, image_parts, \
    parse_mm_limits
from pagedserve.http.errors import APIError
from pagedserve.http.media_fetch import FetchPolicy, fetch, normalize_domains
from pagedserve.http.openai_bodies import ChatMessage
from pagedserve.multimodal.inputs import ImageInput
from pagedserve.multimodal.media import ImageLimits, decode_image, split_data_url

LIMITS = ImageLimits()
RNG = np.random.default_rng(0)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def rgb(width: int = 16, height: int = 12) -> Image.Image:
    return Image.fromarray(RNG.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over a tiny, empty image stream: a bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


# -- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("BMP", "image/bmp"), ("GIF", None),
                                            ("WEBP", "image/webp")])
def test_lossless_formats_decode_to_the_same_pixels(fmt, media_type):
    image = rgb() if fmt != "GIF" else rgb().convert("P").convert("RGB")
    options = {"lossless": True} if fmt == "WEBP" else {}
    decoded = decode_image(encoded(image, fmt, **options), media_type, LIMITS)
    assert decoded.size == (16, 12)
    np.testing.assert_array_equal(decoded.pixels, np.asarray(image))


def test_the_same_pixels_in_two_formats_share_a_content_hash():
    image = rgb()
    assert decode_image(encoded(image, "PNG"), "image/png", LIMITS).content_hash == \
        decode_image(encoded(image, "BMP"), "image/bmp", LIMITS).content_hash


def test_a_decompression_bomb_is_refused_from_its_header_naming_the_limit():
    limits = ImageLimits(max_pixels=1_000_000)
    with pytest.raises(ValueError, match="2000x2000 = 4000000 pixels, over the limit of 1000000"):
        decode_image(png_header_only(2000, 2000), "image/png", limits)
    # Past Pillow's own bomb threshold its error is reported with this limit too.
    with pytest.raises(ValueError, match=f"more pixels than the limit of {LIMITS.max_pixels}"):
        decode_image(png_header_only(100_000, 100_000), "image/png", LIMITS)


def test_a_truncated_png_is_refused():
    data = encoded(rgb(64, 64), "PNG")
    with pytest.raises(ValueError, match="PNG image is truncated or corrupt"):
        decode_image(data[: len(data) // 2], "image/png", LIMITS)


def test_a_polyglot_is_read_as_what_it_was_declared_or_refused():
    gif = encoded(rgb(), "GIF")
    with pytest.raises(ValueError, match=r"GIF data but was declared 'image/png'"):
        decode_image(gif, "image/png", LIMITS)
    # A PNG with something else appended is the PNG it declares itself (the rest is never read).
    png = encoded(rgb(), "PNG") + b"<html><script>alert(1)</script></html>"
    assert decode_image(png, "image/png", LIMITS).size == (16, 12)


@pytest.mark.parametrize("data,message", [
    (b"not an image at all", "not an image in an accepted format"),
    (encoded(rgb(), "TIFF"), "not an image in an accepted format"),
])
def test_data_that_is_not_an_accepted_format_is_refused(data, message):
    with pytest.raises(ValueError, match=message):
        decode_image(data, None, LIMITS)


def test_an_unknown_media_type_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"media type 'image/tiff' is not accepted \(accepted: image/png, image/jpeg"):
        decode_image(encoded(rgb(), "TIFF"), "image/tiff", LIMITS)


def test_an_animated_gif_is_its_first_frame():
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    decoded = decode_image(out.getvalue(), "image/gif", LIMITS)
    assert (decoded.pixels == [255, 0, 0]).all()


def test_a_cmyk_jpeg_becomes_rgb():
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # no black ink, full magenta and yellow: red
    decoded = decode_image(encoded(cmyk, "JPEG", quality=95), "image/jpeg", LIMITS)
    assert decoded.pixels.shape == (8, 8, 3)
    r, g, b = decoded.pixels.reshape(-1, 3).mean(axis=0)
    assert r > 200 and g < 40 and b < 40


def test_a_16_bit_grey_png_keeps_its_top_8_bits():
    grey = np.array([[0, 255, 256, 65535], [4660, 32768, 1000, 50000]], dtype=np.uint16)
    decoded = decode_image(encoded(Image.fromarray(grey), "PNG"), "image/png", LIMITS)
    assert decoded.pixels.dtype == np.uint8
    np.testing.assert_array_equal(decoded.pixels[:, :, 0], grey >> 8)
    assert (decoded.pixels == decoded.pixels[:, :, :1]).all()


def test_alpha_is_composited_on_white():
    rgba = np.array([[[255, 0, 0, 0], [0, 0, 0, 255], [0, 0, 0, 128]]], dtype=np.uint8)
    decoded = decode_image(encoded(Image.fromarray(rgba, "RGBA"), "PNG"), "image/png", LIMITS)
    np.testing.assert_array_equal(decoded.pixels[0, 0], [255, 255, 255])  # transparent: white
    np.testing.assert_array_equal(decoded.pixels[0, 1], [0, 0, 0])  # opaque: itself
    assert 125 <= decoded.pixels[0, 2, 0] <= 129  # half: half-way to white
    la = Image.fromarray(np.array([[[0, 0], [0, 255]]], dtype=np.uint8), "LA")
    np.testing.assert_array_equal(decode_image(encoded(la, "PNG"), None, LIMITS).pixels[0],
                                  [[255, 255, 255], [0, 0, 0]])


def test_a_palette_with_transparency_is_composited_on_white():
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    decoded = decode_image(encoded(image, "PNG", transparency=0), "image/png", LIMITS)
    np.testing.assert_array_equal(decoded.pixels[0], [[255, 255, 255], [255, 0, 0]])


def test_more_bytes_than_the_limit_are_refused_before_decoding():
    with pytest.raises(ValueError, match="over the limit of 100"):
        decode_image(encoded(rgb(), "PNG"), "image/png", ImageLimits(max_bytes=100))


# -- data: URLs --------------------------------------------------------------------------------


def test_a_data_url_gives_its_media_type_and_bytes():
    data = encoded(rgb(), "PNG")
    assert split_data_url(data_url(data), LIMITS) == ("image/png", data)


@pytest.mark.parametrize("url,message", [
    ("data:image/png;base64,!!!notbase64", "not valid base64"),
    ("data:image/png;base64,QUJ", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("data:image/png;base64", "must look like data:<media type>;base64,<data>"),
])
def test_malformed_data_urls_are_refused(url, message):
    with pytest.raises(ValueError, match=message):
        split_data_url(url, LIMITS)


def test_a_50_mb_base64_string_is_refused_by_its_length_without_decoding():
    url = "data:image/png;base64," + "A" * 50_000_000
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="50000000 characters, over the limit of 27962028"):
            split_data_url(url, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing the size of the string was made


# -- --limit-mm-per-prompt ----------------------------------------------------------------------


def test_limit_mm_per_prompt_takes_vllms_spellings():
    assert parse_mm_limits("image=4") == parse_mm_limits('{"image": 4}') == {"image": 4}
    assert parse_mm_limits("image=0") == {"image": 0}


@pytest.mark.parametrize("text,message", [
    ("video=1", "modality 'video' is not supported"),
    ("image=many", "modality=count pairs"),
    ("image=-1", r"image must be an integer in \[0, 64\]"),
    (f'{{"image": {MAX_IMAGES_PER_PROMPT + 1}}}', r"image must be an integer in \[0, 64\]"),
    ('{"image": 4', "not valid JSON"),
    ("[4]", "modality=count pairs"),
])
def test_limit_mm_per_prompt_refuses_what_it_cannot_enforce(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mm_limits(text)


# -- a chat request's images, with a fake vision model ------------------------------------------


class FakeVision:
    placeholder = "<image>"

    def tokens_per_image(self, image: ImageInput) -> int:
        return image.size[0] * image.size[1] // 4


def loader(vision: FakeVision | None = FakeVision(), **policy) -> ImageLoader:
    # The placeholder tokenises to 3 tokens in this fake.
    return ImageLoader(ImagePolicy(**policy), vision, lambda text: [1, 2, 3] if text == "<image>" else [9])


def messages_with(*urls: str) -> list[ChatMessage]:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    return [ChatMessage.model_validate({"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]})]


def test_images_load_in_order_and_their_tokens_count_in_the_prompt():
    first, second = rgb(8, 8), rgb(16, 4)
    parts = image_parts(messages_with(data_url(encoded(first, "PNG")), data_url(encoded(second, "BMP"), "image/bmp")))
    images = loader().load(parts)
    np.testing.assert_array_equal(images[0].pixels, np.asarray(first))
    np.testing.assert_array_equal(images[1].pixels, np.asarray(second))
    # 10 text tokens of which 2 x 3 are the placeholders, plus 16 + 16 image tokens.
    assert loader().prompt_tokens("<image>\n<image>\nwhat?", list(range(10)), images) == 10 - 6 + 32


def test_a_text_only_model_refuses_images_naming_the_model():
    with pytest.raises(APIError, match="the model 'smol' does not accept images") as e:
        loader(None).check(image_parts(messages_with("data:image/png;base64,AAAA")), "smol")
    assert e.value.status == 400


def test_a_thousand_images_are_refused_before_any_is_decoded():
    started = time.perf_counter()
    with pytest.raises(APIError, match=f"1000 images; a prompt may hold at most {MAX_IMAGES_PER_PROMPT}"):
        image_parts(messages_with(*["data:image/png;base64,!!"] * 1000))
    assert time.perf_counter() - started < 1.0


def test_more_images_than_limit_mm_per_prompt_are_refused_naming_the_flag():
    with pytest.raises(APIError, match=r"3 images; this server takes at most 2 per prompt \(--limit-mm-per-prompt\)"):
        loader(max_images=2).check(image_parts(messages_with(*["data:image/png;base64,!!"] * 3)), "smol")


def test_a_bad_image_is_a_400_saying_which_one():
    parts = image_parts(messages_with(data_url(encoded(rgb(), "PNG")), "data:image/png;base64,@@", "ftp://x/y.png"))
    with pytest.raises(APIError, match="image 2 of 3: the image data is not valid base64") as e:
        loader().load(parts)
    assert e.value.status == 400
    with pytest.raises(APIError, match="image 1 of 1: an image URL must be a data: URL or an http"):
        loader().load(parts[2:])


def test_placeholder_text_in_a_message_does_not_pass_for_an_image():
    with pytest.raises(APIError, match=r"holds the image placeholder '<image>' 2 times for 1 images"):
        loader().prompt_tokens("<image>\n<image> pretending", [1, 2, 3, 1, 2, 3], [ImageInput.from_array(
            np.zeros((2, 2, 3), np.uint8))])


def test_an_unlisted_url_is_refused_naming_the_flag():
    with pytest.raises(APIError, match="image 1 of 1: the image URL's host '169.254.169.254' is not in "
                                       "--allowed-media-domains"):
        loader().load(image_parts(messages_with("http://169.254.169.254/latest/meta-data")))


# -- fetching ------------------------------------------------------------------------------------


PNG = encoded(rgb(), "PNG")


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/image.png":
            self._send(200, PNG, "image/png")
        elif self.path == "/away":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/image.png")
            self.end_headers()
        elif self.path == "/here":
            self.send_response(302)
            self.send_header("Location", "/image.png")
            self.end_headers()
        elif self.path == "/big":
            self._send(200, b"\0" * 5000, "image/png")
        elif self.path == "/unsized":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\0" * 5000)
        elif self.path == "/slow":
            time.sleep(1.5)
            try:
                self._send(200, PNG, "image/png")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up, as it should
        elif self.path == "/html":
            self._send(200, PNG, "text/html")
        else:
            self._send(404, b"", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def policy(*hosts: str, max_bytes: int = LIMITS.max_bytes, timeout_s: float = 5.0) -> FetchPolicy:
    return FetchPolicy(normalize_domains(hosts), max_bytes, timeout_s)


def test_a_listed_address_is_fetched(image_server):
    assert fetch(f"{image_server}/image.png", policy("127.0.0.1")) == (PNG, "image/png")
    assert fetch(f"{image_server}/here", policy("127.0.0.1")) == (PNG, "image/png")  # a redirect on the list


def test_an_unlisted_host_is_never_contacted(image_server):
    with pytest.raises(ValueError, match="host '127.0.0.1' is not in --allowed-media-domains"):
        fetch(f"{image_server}/image.png", policy())
    with pytest.raises(ValueError, match="host '127.0.0.1' is not in --allowed-media-domains"):
        fetch(f"{image_server}/image.png", policy("example.com"))


def test_a_listed_name_that_resolves_to_loopback_is_refused(image_server):
    url = image_server.replace("127.0.0.1", "localhost")
    with pytest.raises(ValueError, match="'localhost' resolves to .*loopback, private or link-local address; list "
                                         "that address itself"):
        fetch(f"{url}/image.png", policy("localhost"))


def test_a_redirect_off_the_list_is_refused(image_server):
    with pytest.raises(ValueError, match="host 'localhost' is not in --allowed-media-domains"):
        fetch(f"{image_server}/away", policy("127.0.0.1"))


@pytest.mark.parametrize("path,message", [("/big", "5000 bytes, over the limit of 1000"),
                                          ("/unsized", "more than 1000 bytes, the limit")])
def test_a_listed_url_too_big_is_refused(image_server, path, message):
    with pytest.raises(ValueError, match=message):
        fetch(f"{image_server}{path}", policy("127.0.0.1", max_bytes=1000))


def test_a_listed_url_that_times_out_is_refused(image_server):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"took longer than 0.3 s"):
        fetch(f"{image_server}/slow", policy("127.0.0.1", timeout_s=0.3))
    assert time.perf_counter() - started < 1.2


@pytest.mark.parametrize("path,message", [("/missing", "answered HTTP 404"), ("/html", "served as 'text/html'")])
def test_a_listed_url_that_is_not_an_image_is_refused(image_server, path, message):
    with pytest.raises(ValueError, match=message):
        fetch(f"{image_server}{path}", policy("127.0.0.1"))


def test_urls_with_credentials_or_odd_schemes_are_refused():
    with pytest.raises(ValueError, match="may not carry credentials"):
        fetch("http://user:pw@127.0.0.1/x.png", policy("127.0.0.1"))
    with pytest.raises(ValueError, match="scheme must be data, http or https, got 'file'"):
        fetch("file:///etc/passwd", policy("127.0.0.1"))


def test_allowed_media_domains_takes_hosts_only():
    assert normalize_domains(["Example.COM", "[::1]"]) == {"example.com", "::1"}
    with pytest.raises(ValueError, match="no scheme, port or path"):
        normalize_domains(["https://example.com"])


def test_a_fetched_image_goes_through_the_loader(image_server):
    images = loader(allowed_domains=normalize_domains(["127.0.0.1"])).load(
        image_parts(messages_with(f"{image_server}/image.png")))
    np.testing.assert_array_equal(images[0].pixels, np.asarray(Image.open(io.BytesIO(PNG)).convert("RGB")))
