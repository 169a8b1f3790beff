"""Ollama's API wire format: the request bodies of /api/chat, /api/generate, /api/embed,
/api/embeddings and /api/show, and their `options` turned into the chat request's fields.

Ollama's sampling options live under `options` with llama.cpp's names (num_predict,
repeat_penalty, ...). Each becomes the chat field of the same meaning, so the sampling
parameters are built, bounded and refused by the chat path itself
(entrypoints/openai/serving_ollama.py). An option that would change the arithmetic and
that the engine does not implement (mirostat, tfs_z, typical_p, ...) is refused by name
unless it holds its "off" value; options that change no result here (threads, devices,
num_keep) are accepted.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from .errors import APIError
from .json_body import StrictModel

# Ollama's own num_predict values: -1 generates until the model stops, -2 until the context is full.
_UNBOUNDED_PREDICT = (-1, -2)
# Options of the llama.cpp runner whose effect this engine does not implement: refused by
# name unless they hold the value that turns them off (what this engine computes).
_UNSUPPORTED_OPTIONS = {
    "tfs_z": ("tail-free sampling", (1,)), "typical_p": ("locally typical sampling", (1,)),
    "mirostat": ("mirostat sampling", (0,)),
    # The penalties here cover every token, newlines included: penalize_newline true.
    "penalize_newline": ("a repeat penalty that spares newlines", (True,)),
    "logits_all": ("all-position logits", (False,)), "vocab_only": ("loading only the vocabulary", (False,)),
    "embedding_only": ("an embedding-only load (the server's --task decides it)", (False,)),
}
# Options that change no result here: placement and threads (the server's flags decide them),
# f16_kv (Ollama ignores it too; --kv-cache-dtype decides), num_keep (a prompt never slides
# out of the context: one that does not fit is refused), mirostat's tau and eta (mirostat is off).
_NO_EFFECT_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "use_mmap", "use_mlock",
                                "num_thread", "f16_kv", "num_keep", "mirostat_tau", "mirostat_eta"})
# Option -> the chat request field of the same meaning.
_SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                     "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
                     "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# The chat path's names in its error messages -> the names an Ollama client wrote.
CHAT_TO_OLLAMA_NAMES = {"max_completion_tokens": "options.num_predict", "max_tokens": "options.num_predict",
                        "repetition_penalty": "options.repeat_penalty", "response_format": "format",
                        "thinking_token_budget": "think", "reasoning_effort": "think"}
_KEEP_ALIVE = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_ThinkLevel = Annotated[str, Field(pattern="^(low|medium|high)$")]


class OllamaToolCallFunction(StrictModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(StrictModel):
    function: OllamaToolCallFunction
    id: str | None = None


class OllamaMessage(StrictModel):
    role: str = Field(min_length=1)
    content: str = ""
    thinking: str | None = None  # an earlier reply's reasoning: templates leave it out of the prompt
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class _OllamaBody(StrictModel):
    model: str = Field(min_length=1)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class _OllamaGenerationBody(_OllamaBody):
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | _ThinkLevel | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaChatRequest(_OllamaGenerationBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_OllamaGenerationBody):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class OllamaEmbedRequest(_OllamaBody):
    input: str | list[str]
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None


class OllamaEmbeddingsRequest(_OllamaBody):
    """The older /api/embeddings: one prompt, one vector."""

    prompt: str


class OllamaShowRequest(StrictModel):
    model: str = Field(min_length=1)
    verbose: bool = False


@dataclass(frozen=True, slots=True)
class OllamaSampling:
    """A request's options as chat request fields, and its own context window (num_ctx)."""

    chat_fields: dict[str, Any]
    num_ctx: int | None


def sampling_options(options: dict[str, Any] | None, max_model_len: int) -> OllamaSampling:
    """`options` as chat fields; 400 naming the option for one that is unknown, not
    implemented, or a num_ctx beyond the model's context length. Values are checked by
    the chat request model and SamplingParams (their errors are renamed by the caller)."""
    fields: dict[str, Any] = {}
    num_ctx = None
    for name, value in (options or {}).items():
        if name == "seed" and value == -1 and not isinstance(value, bool):
            continue  # Ollama's "a random seed": no seed
        if name in _SAMPLING_OPTIONS:
            fields[_SAMPLING_OPTIONS[name]] = value
        elif name == "num_predict":
            fields.update(_num_predict(value))
        elif name == "num_ctx":
            num_ctx = _num_ctx(value, max_model_len)
        elif name == "repeat_last_n":
            _repeat_last_n(value)
        elif name in _UNSUPPORTED_OPTIONS:
            what, off = _UNSUPPORTED_OPTIONS[name]
            # true is not 1 here: a flag and a number are different settings.
            if value is not None and not any(value == o and isinstance(value, bool) == isinstance(o, bool)
                                             for o in off):
                raise APIError(400, f"options.{name} is not supported: this server does not implement {what} "
                                    f"(only {json.dumps(off[0])}: what this server computes)", param=f"options.{name}")
        elif name not in _NO_EFFECT_OPTIONS:
            raise APIError(400, f"options.{name} is not an option this server knows", param=f"options.{name}")
    return OllamaSampling(fields, num_ctx)


def _num_predict(value: Any) -> dict[str, Any]:
    if value is None or value in _UNBOUNDED_PREDICT:
        return {}  # the room left in the context
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise APIError(400, f"options.num_predict must be an integer >= 1, or -1 (until the model stops) or -2 "
                            f"(until the context is full), got {value!r}", param="options.num_predict")
    return {"max_tokens": value}


def _num_ctx(value: Any, max_model_len: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise APIError(400, f"options.num_ctx must be an integer >= 1, got {value!r}", param="options.num_ctx")
    if value > max_model_len:
        raise APIError(400, f"options.num_ctx is {value}, beyond this model's maximum context length of "
                            f"{max_model_len} tokens (the server's --max-model-len)", param="options.num_ctx")
    return value


def _repeat_last_n(value: Any) -> None:
    """The penalties here see the whole context: only -1 (Ollama's "the whole context") is that."""
    if value not in (None, -1):
        raise APIError(400, f"options.repeat_last_n must be -1: the penalties here always see the whole context, "
                            f"got {value!r}", param="options.repeat_last_n")


def format_field(value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's `format` ("json" or a JSON schema) as chat's response_format (None: free text)."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise APIError(400, f"format must be \"json\" or a JSON schema object, got {value!r}", param="format")


def think_fields(think: bool | str | None) -> dict[str, Any]:
    """`think` as chat fields: false turns the template's thinking off, a level is a
    thinking budget as chat's reasoning_effort, true and absent leave the template's default."""
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if isinstance(think, str):
        return {"reasoning_effort": think}
    return {}


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a duration ("5m", "1h",
    "300ms"); negative keeps the model loaded for good (inf); None when not given; 400
    for anything else."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _KEEP_ALIVE.match(str(value).strip())
        if match is None:
            raise APIError(400, f"keep_alive must be a number of seconds or a duration such as \"5m\", "
                                f"got {value!r}", param="keep_alive")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return math.inf if seconds < 0 else seconds
