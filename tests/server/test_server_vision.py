"""Images end to end: a tiny random SmolVLM (tests/vision_model.py) served, and each API
(chat whole and streamed, Messages, Responses, count_tokens) sent an image by the official
openai and anthropic clients. The server's greedy reply and prompt-token count must equal
the offline engine's on the same rendered prompt and pixels; a second, different image on
the same text must not be answered from the first one's cached prefix."""
from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from vision_model import write_vision_model
from pagedserve import LLM, SamplingParams
from pagedserve.multimodal.inputs import ImageInput

from .server_process import ServerProcess, start_server

QUESTION = "describe the picture in a few words, please. "
MAX_TOKENS = 6
FLAGS = ("--max-model-len", "512", "--served-model-name", "vlm")


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (50, 70, 3), dtype=np.uint8)


def _png_b64(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vision_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smolvlm")
    write_vision_model(folder)
    return folder


@pytest.fixture(scope="module")
def vision_server(vision_folder, server_logs) -> Iterator[ServerProcess]:
    proc = start_server(server_logs, "--model", str(vision_folder), *FLAGS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(vision_folder):
    """(text, prompt tokens) of the offline engine's greedy reply for an image seed."""
    llm = LLM(model=str(vision_folder), max_model_len=512)
    prompt = f"User:{QUESTION}<image><end_of_utterance>\nAssistant:"

    def answer(seed: int) -> tuple[str, int]:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False,
                           images=[ImageInput.from_array(_pixels(seed))])[0]
        return out.outputs[0].text, len(out.prompt_token_ids)
    return answer


@pytest.fixture(scope="module")
def oai(vision_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(vision_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=120)


def _chat_messages(seed: int) -> list[dict]:
    url = f"data:image/png;base64,{_png_b64(_pixels(seed))}"
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]


def _claude_messages(seed: int) -> list[dict]:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png_b64(_pixels(seed))}}
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}]


@pytest.mark.parametrize("seed", [1, 2])  # the second image follows the first on the same text
def test_chat_answers_as_the_offline_engine(oai, offline, seed):
    text, prompt_tokens = offline(seed)
    r = oai.chat.completions.create(model="vlm", messages=_chat_messages(seed), max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt_tokens


def test_chat_stream_answers_as_the_offline_engine(oai, offline):
    text, _ = offline(3)
    chunks = oai.chat.completions.create(model="vlm", messages=_chat_messages(3), max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_messages_answer_and_count_tokens(claude, offline):
    text, prompt_tokens = offline(1)
    m = claude.messages.create(model="vlm", max_tokens=MAX_TOKENS, messages=_claude_messages(1),
                               extra_body={"temperature": 0})
    assert "".join(b.text for b in m.content if b.type == "text") == text
    assert m.usage.input_tokens == prompt_tokens
    assert claude.messages.count_tokens(model="vlm", messages=_claude_messages(1)).input_tokens == prompt_tokens


def test_responses_input_image(oai, offline):
    text, prompt_tokens = offline(2)
    url = f"data:image/png;base64,{_png_b64(_pixels(2))}"
    r = oai.responses.create(model="vlm", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": url}]}])
    assert r.output_text == text
    assert r.usage.input_tokens == prompt_tokens


def test_too_many_images_is_a_400(oai):
    messages = _chat_messages(1)
    messages[0]["content"] += messages[0]["content"][1:] * 8  # 9 images, over the default limit of 8
    with pytest.raises(openai.BadRequestError, match="image"):
        oai.chat.completions.create(model="vlm", messages=messages, max_tokens=1)
