"""Images on a text-only model, through the official clients: chat, Messages and Responses,
streamed or not, and /tokenize and count_tokens, each answer a 400 in its API's shape
naming the model; malformed image parts and too many images are 400s too, never a 5xx.
(The decoding table runs without a server: tests/test_media.py.)"""
from __future__ import annotations

import argparse
import base64
import io

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from pagedserve.entrypoints.openai.args import ServerConfig, add_server_args, server_config_from_args

NO_IMAGES = "does not accept images"


def _png() -> str:
    out = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG_B64 = _png()
DATA_URL = f"data:image/png;base64,{PNG_B64}"
CHAT_IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}},
                                            {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_an_image_on_a_text_only_model_is_a_400(client, model, stream):
    with pytest.raises(openai.BadRequestError, match=NO_IMAGES) as e:
        client.chat.completions.create(model=model, messages=CHAT_IMAGE, max_tokens=4, stream=stream)
    assert model in e.value.message and e.value.body["param"] == "messages"


@pytest.mark.parametrize("source", [{"type": "base64", "media_type": "image/png", "data": PNG_B64},
                                    {"type": "url", "url": "https://example.com/cat.png"}])
@pytest.mark.parametrize("stream", [False, True])
def test_messages_with_an_image_on_a_text_only_model_is_a_400(claude, model, stream, source):
    content = [{"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]
    with pytest.raises(anthropic.BadRequestError, match=NO_IMAGES) as e:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": content}],
                               stream=stream)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_with_an_image_on_a_text_only_model_is_a_400(client, model, stream):
    content = [{"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
               {"type": "input_text", "text": "What is this?"}]
    with pytest.raises(openai.BadRequestError, match=NO_IMAGES) as e:
        client.responses.create(model=model, input=[{"role": "user", "content": content}], max_output_tokens=4,
                                stream=stream)
    assert e.value.body["param"] == "input"


def test_token_counts_with_an_image_on_a_text_only_model_are_a_400(http, claude, model):
    r = http.post("/tokenize", json={"model": model, "messages": CHAT_IMAGE})
    assert r.status_code == 400 and NO_IMAGES in r.json()["error"]["message"]
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}]
    with pytest.raises(anthropic.BadRequestError, match=NO_IMAGES):
        claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": content}])


def test_a_thousand_images_are_a_400_before_any_is_read(client, model):
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}] * 1000
    with pytest.raises(openai.BadRequestError, match="1000 images; a prompt may hold at most 64"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=4)


@pytest.mark.parametrize("part,message", [
    ({"type": "image_url", "image_url": {"url": DATA_URL, "detail": "ultra"}}, "detail"),
    ({"type": "image_url", "image_url": {"url": ""}}, "url"),
    ({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}, "input_audio"),
])
def test_malformed_image_parts_are_400s(http, part, message):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}], "max_tokens": 4})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_responses_refuses_an_image_by_file_id(http):
    content = [{"type": "input_image", "file_id": "file-123"}]
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and "file_id is not supported" in r.json()["error"]["message"]


def test_messages_refuses_an_image_in_an_assistant_turn(claude, model):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [image]},
             {"role": "user", "content": "And?"}]
    with pytest.raises(anthropic.BadRequestError, match="image blocks belong in user turns"):
        claude.messages.create(model=model, max_tokens=4, messages=turns)


def test_text_only_requests_still_work(client, model):
    r = client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert r.usage.completion_tokens == 2


def _config(*flags: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return server_config_from_args(parser.parse_args(["--model", "m", *flags]))


def test_the_image_flags_parse_and_refuse_what_they_cannot_enforce():
    config = _config("--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "Images.Example.com",
                     "10.0.0.5")
    assert config.image_policy().max_images == 2
    assert config.image_policy().allowed_domains == {"images.example.com", "10.0.0.5"}
    assert _config().image_policy().allowed_domains == frozenset()
    with pytest.raises(SystemExit):
        _config("--limit-mm-per-prompt", "audio=1")
    with pytest.raises(ValueError, match="no scheme, port or path"):
        _config("--allowed-media-domains", "http://example.com/")
