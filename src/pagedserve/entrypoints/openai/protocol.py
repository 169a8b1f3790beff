"""The OpenAI wire format: request bodies in, SamplingParams out, errors in OpenAI's shape.

Request models are strict (no "5" for 5, no true for 1) and ignore unknown fields.
Value ranges are not checked here: SamplingParams owns those checks, and its
ValueError messages start with the parameter name, which becomes the error's
`param`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse

from ...sampling_params import SamplingParams
from ...structured_output.spec import StructuredOutputs

MAX_STOP_STRINGS = 16
_MAX_MESSAGE_CHARS = 1000
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message[:_MAX_MESSAGE_CHARS]
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(error: ValueError | str, param: str | None = None) -> APIError:
    """A 400 from a ValueError; `param` defaults to the message's leading field name."""
    message = str(error)
    if param is None:
        match = re.match(r"[A-Za-z_]+", message)
        param = match.group(0) if match and match.group(0) in _FIELD_NAMES else None
    return APIError(400, message, param=param)


# -- request bodies ------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


class _GenerationRequest(_Model):
    """Fields both endpoints share; None means "not given" everywhere."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras, passed to the engine.
    priority: int = 0
    cache_salt: str | None = None
    # vLLM's structured-output fields (the guided_* ones are its older spelling).
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_output_fields(self) -> dict[str, dict[str, Any]]:
        """The structured-output fields the client set: name -> StructuredOutputs arguments."""
        given = {
            "guided_json": ("json", self.guided_json), "guided_regex": ("regex", self.guided_regex),
            "guided_choice": ("choice", self.guided_choice), "guided_grammar": ("grammar", self.guided_grammar),
        }
        out = {param: {name: value} for param, (name, value) in given.items() if value is not None}
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs
        return out


class CompletionRequest(_GenerationRequest):
    prompt: Any = None  # a string, strings, token ids or lists of token ids: see `prompts`
    max_tokens: int | None = None  # OpenAI's default for completions: 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[dict[str, Any]] | None = None  # text parts are checked when rendering
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # default: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: Any = None  # refused: templates are server-side code
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def structured_output_fields(self) -> dict[str, dict[str, Any]]:
        out = super().structured_output_fields()
        constraint = _response_format(self.response_format)
        if constraint is not None:
            out["response_format"] = constraint
        return out


def _response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format (text: no constraint, json_object, json_schema) as StructuredOutputs arguments."""
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return {"json": schema["schema"]}
    raise APIError(400, f"response_format.type must be one of text, json_object, json_schema, got {kind!r}",
                   param="response_format")


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


_FIELD_NAMES = frozenset(
    name for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
    for name in model.model_fields
) | {"max_model_len", "context_length"}


M = TypeVar("M", bound=_Model)


def parse_body(body: bytes, model: type[M]) -> M:
    """Decode a JSON object body into `model`, or raise a 400 APIError."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at position {e.pos}") from None
    except (ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got a JSON {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(error: ValidationError | Any) -> APIError:
    """pydantic's errors (ours or FastAPI's) as one 400: the first problem, with its field."""
    errors = error.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = str(loc[0]) if loc else None
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    return APIError(400, f"{path or 'body'}: {first.get('msg', 'invalid value')}", param=param)


# -- prompts --------------------------------------------------------------------------------

Prompt = str | list[int]


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def completion_prompts(prompt: Any) -> list[Prompt]:
    """OpenAI's prompt forms as a list: one text, texts, one token-id list, or several."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
    if prompt is None:
        raise APIError(400, "prompt is required", param="prompt")
    raise APIError(
        400, "prompt must be a non-empty string, a list of strings, a list of token ids or a list of token-id lists",
        param="prompt",
    )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise APIError(400, f"{param} contains token id {bad}, outside the vocabulary [0, {vocab_size - 1}]",
                       param=param)


# -- sampling --------------------------------------------------------------------------------


def structured_output_param(req: _GenerationRequest) -> str | None:
    """The one structured-output field the request set (None if none); 400 for several."""
    fields = list(req.structured_output_fields())
    if len(fields) > 1:
        raise APIError(400, f"give at most one structured-output field, got {', '.join(fields)}", param=fields[0])
    return fields[0] if fields else None


def structured_outputs(req: _GenerationRequest) -> StructuredOutputs | None:
    """The request's output constraint, checked for shape (compiling it is the server's next step)."""
    param = structured_output_param(req)
    if param is None:
        return None
    try:
        return StructuredOutputs(**req.structured_output_fields()[param])
    except TypeError:
        raise APIError(400, f"{param} takes only json, regex, choice, grammar and json_object", param=param) from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_n: int
    max_logprobs: int
    vocab_size: int


def sampling_params(req: _GenerationRequest, limits: RequestLimits, *, max_tokens: int | None,
                    logprobs: int | None, logprobs_param: str) -> SamplingParams:
    """SamplingParams for a request; every invalid value is a 400 naming its field."""
    n = 1 if req.n is None else req.n
    if n > limits.max_n:
        raise APIError(400, f"n must be at most {limits.max_n} on this server, got {n}", param="n")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise APIError(400, f"{logprobs_param} must be at most {limits.max_logprobs} on this server, got {logprobs}",
                       param=logprobs_param)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    constraint = structured_outputs(req)
    try:
        params = SamplingParams(
            structured_outputs=constraint, n=n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
            logit_bias=req.logit_bias, stop=stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            **{name: value for name, value in given.items() if value is not None},
        )
        params.validate_for_vocab(limits.vocab_size)
        return params
    except ValueError as e:
        raise bad_request(e) from None


def completion_sampling_params(req: CompletionRequest, limits: RequestLimits) -> SamplingParams:
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    return sampling_params(req, limits, max_tokens=max_tokens, logprobs=req.logprobs, logprobs_param="logprobs")


def chat_sampling_params(req: ChatCompletionRequest, limits: RequestLimits) -> SamplingParams:
    """Params with max_tokens None when the client gave none (the server fills in the room left)."""
    if req.chat_template is not None:
        raise APIError(400, "chat_template is not accepted from requests; the server uses the model's template",
                       param="chat_template")
    if req.tools:
        raise APIError(400, "tools are not supported by this server", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    return sampling_params(req, limits, max_tokens=max_tokens, logprobs=logprobs, logprobs_param="top_logprobs")


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template sees: role and content always, name when given."""
    return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
            for m in messages]
