"""The OpenAI wire format: request bodies in, SamplingParams out, errors in OpenAI's shape.

Request models are strict (no "5" for 5, no true for 1), ignore unknown fields, and
declare every static bound, so they double as the published OpenAPI schema. What
passes them is then checked again by SamplingParams (whose ValueError messages start
with the parameter name, which becomes the error's `param`) and against the model
and the server's flags.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, WithJsonSchema

from ...core.validation import is_int
from ...http.errors import APIError
from ...sampling_params import MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_LOGPROBS, SamplingParams
from ...structured_output.spec import StructuredOutputs

MAX_STOP_STRINGS = 16
# Each stop string is searched for in the new text of every step; a bound keeps that cheap.
MAX_STOP_STRING_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 1024
# A constraint's text (schema, regex, grammar, choices) is compiled on every cache miss;
# beyond this size it is refused before compiling (the compile timeout catches the rest).
MAX_CONSTRAINT_CHARS = 64 * 1024
def bad_request(error: ValueError | str, param: str | None = None) -> APIError:
    """A 400 from a ValueError; `param` defaults to the message's leading field name."""
    message = str(error)
    if param is None:
        match = re.match(r"[A-Za-z_]+", message)
        param = match.group(0) if match and match.group(0) in _FIELD_NAMES else None
    return APIError(400, message, param=param)


# -- request bodies ------------------------------------------------------------------------
#
# The models below are both the parser and the published schema (/openapi.json): every
# bound a field declares here is enforced by pydantic and appears in the document, so the
# two cannot disagree. Bounds that depend on the model or on server flags (the context
# length, the vocabulary, --max-n, --max-logprobs) are checked after parsing and named in
# the field descriptions.

_NonEmptyStr = Annotated[str, Field(min_length=1)]
_TokenId = Annotated[int, Field(ge=0)]
_Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
_Penalty = Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY, allow_inf_nan=False)]
_LOGIT_BIAS_KEY = r"^[0-9]+$"
_LogitBias = Annotated[
    dict[Annotated[str, StringConstraints(pattern=_LOGIT_BIAS_KEY)],
         Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS, allow_inf_nan=False)]],
    Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
    # pydantic writes key patterns as patternProperties without closing the object.
    WithJsonSchema({"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES, "additionalProperties": False,
                    "patternProperties": {_LOGIT_BIAS_KEY: {"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS,
                                                            "maximum": MAX_ABS_LOGIT_BIAS}}}),
]
_StopStrings = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
                         Field(max_length=MAX_STOP_STRINGS)]
_ConstraintText = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


class _GenerationRequest(_Model):
    """Fields both endpoints share; None means "not given" everywhere."""

    model: str | None = Field(None, description="One of the names /v1/models lists; default: the first.")
    n: Annotated[int, Field(ge=1, description="Samples per prompt; at most --max-n (default 16).")] | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False, description="0 = greedy.")] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, description="0 or -1 = off.")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seed: int | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False, description="1 = off.")] | None = None
    logit_bias: _LogitBias | None = Field(None, description="Token id (as a string) -> bias; ids below the "
                                                            "vocabulary size.")
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)] | _StopStrings | None = None
    stop_token_ids: Annotated[list[_TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, description="At most max_tokens.")] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras, passed to the engine.
    priority: int = Field(0, description="Lower runs first under --scheduling-policy priority.")
    cache_salt: str | None = None
    # Disaggregated prefill/decode (docs/disaggregated.md): {"do_remote_decode": true} on a
    # prefill instance; the prefill's response's kv_transfer_params on a decode instance.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's structured-output fields (the guided_* ones are its older spelling); at most one may be given.
    guided_json: _ConstraintText | dict[str, Any] | None = None
    guided_regex: _ConstraintText | None = None
    guided_choice: Annotated[list[_NonEmptyStr], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: _ConstraintText | None = Field(None, description="A Lark grammar (or GBNF).")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="Exactly one of json, regex, choice, grammar, json_object.")

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


_PROMPT_SCHEMA = {
    "description": "A string, a list of strings, a list of token ids, or a list of token-id lists; each prompt "
                   "non-empty, token ids below the vocabulary size, prompt tokens plus max_tokens within the "
                   "context length, at most --max-queued-requests prompts.",
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "minItems": 1,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
    ],
}


class CompletionRequest(_GenerationRequest):
    # Checked by `completion_prompts`, whose messages say which form was wrong; the schema says the same.
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: Annotated[int, Field(ge=0, description="Default 16; 0 only with echo (scores the prompt).")] | None = None
    logprobs: _Logprobs | None = Field(None, description="At most --max-logprobs.")
    echo: bool = False
    best_of: int | None = Field(None, description="Only n itself is supported.")
    suffix: Annotated[str, Field(max_length=0, description="Not supported: must be empty.")] | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: str = Field(min_length=1, description="system, user, assistant, or another role the chat template knows.")
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls, checked when rendering (tools.py)
    tool_call_id: str | None = None  # a tool result's call


_RESPONSE_FORMAT_SCHEMA = {
    "oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}},
        }},
    ],
}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, description="Default: the room left in the context.")] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, description="Takes precedence over max_tokens.")] | None = None
    logprobs: bool = False
    top_logprobs: _Logprobs | None = Field(None, description="Needs logprobs; at most --max-logprobs.")
    prompt_logprobs: _Logprobs | None = Field(
        None, description="vLLM's extension: the response's `prompt_logprobs` holds, per prompt token, its "
                          "logprob and the top k (null for the first); at most --max-logprobs; not with stream.")
    # Refused with a message saying why: templates are server-side code.
    chat_template: Annotated[Any, WithJsonSchema({"type": "null", "description": "Not accepted from requests."})] = None
    # Checked by tools.py, whose messages name the tool at fault.
    tools: Annotated[list[Any], WithJsonSchema({
        "type": "array", "items": {"type": "object"},
        "description": "Function tools: {type: function, function: {name, description, parameters}}."})] | None = None
    tool_choice: Annotated[str | dict[str, Any], Field(
        description="none, auto, required, or {type: function, function: {name}}.")] | None = None
    parallel_tool_calls: bool = True
    response_format: Annotated[dict[str, Any], WithJsonSchema(_RESPONSE_FORMAT_SCHEMA)] | None = None

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
        if not isinstance(schema.get("name", ""), str):
            # The published schema says so; a null name must not pass silently.
            raise APIError(400, "response_format.json_schema.name must be a string", param="response_format")
        return {"json": schema["schema"]}
    raise APIError(400, f"response_format.type must be one of text, json_object, json_schema, got {kind!r}",
                   param="response_format")


class TokenizeRequest(_Model):
    """Exactly one of prompt and messages."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    # Not nullable, so that "exactly one given" is what the schema's oneOf says.
    prompt: str = None  # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[_TokenId] = Field(description="Token ids below the vocabulary size.")


_FIELD_NAMES = frozenset(
    name for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
    for name in model.model_fields
) | {"max_model_len", "context_length"}


M = TypeVar("M", bound=_Model)


def parse_body(body: bytes, model: type[M]) -> M:
    """Decode a JSON object body into `model`, or raise a 400 APIError."""
    try:
        data = json.loads(body, parse_float=_json_number)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at position {e.pos}") from None
    except (ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got a JSON {type(data).__name__}")
    _refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _json_number(text: str) -> int | float:
    """A JSON number with a fraction part: 2.0 is an int (JSON Schema counts it as an
    integer, and some clients write counts that way); 2.5 stays a float, which strict
    parsing refuses where an integer is due."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """400 for a string holding an unpaired UTF-16 surrogate ("\\ud800" is valid JSON but
    not Unicode text: no tokenizer or template can take it)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # Only now look for the field, so the common case costs one pass; a field whose
        # name is not Unicode cannot be named in a (UTF-8) response.
        param = next((key for key, value in data.items()
                      if not _has_lone_surrogate(key) and _has_lone_surrogate(json.dumps(value, ensure_ascii=False))),
                     None)
        raise APIError(400, f"{param or 'the body'} contains an unpaired UTF-16 surrogate, which is not valid "
                            "Unicode text", param=param) from None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_LOCATION_NOISE = frozenset({"body", "query", "path", "header", "str", "int", "float", "bool", "dict", "list"})


def validation_error(error: ValidationError | Any) -> APIError:
    """pydantic's errors (ours or FastAPI's) as one 400: the first problem, with its field."""
    errors = error.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    # pydantic names union members in the location ("stop.list[constrained-str].0"); clients
    # know only field names and indices.
    loc = [part for part in first.get("loc", ())
           if isinstance(part, int) or (part.isidentifier() and part not in _LOCATION_NOISE)]
    param = str(loc[0]) if loc else None
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    return APIError(400, f"{path or 'body'}: {first.get('msg', 'invalid value')}", param=param)


# -- prompts --------------------------------------------------------------------------------

Prompt = str | list[int]


def completion_prompts(prompt: Any) -> list[Prompt]:
    """OpenAI's prompt forms as a list: one text, texts, one token-id list, or several."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
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
        spec = StructuredOutputs(**req.structured_output_fields()[param])
    except TypeError:
        raise APIError(400, f"{param} takes only json, regex, choice, grammar and json_object", param=param) from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    size = len(spec.key[1])
    if size > MAX_CONSTRAINT_CHARS:
        raise APIError(400, f"{param} is {size} characters long; this server compiles at most "
                            f"{MAX_CONSTRAINT_CHARS}", param=param)
    return spec


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_n: int
    max_logprobs: int
    vocab_size: int
    # Longer prompt text cannot fit the context whatever it tokenises to (see `max_prompt_chars`),
    # so it is refused before spending the tokenizer's time on it.
    max_prompt_chars: int


def max_prompt_chars(vocabulary: Iterable[str], max_context_len: int) -> int:
    """Characters of text that could at most fit `max_context_len` tokens: no token covers
    more characters than its vocabulary spelling has (byte-level spellings have one
    character per byte, SentencePiece ones one per character, byte-fallback ones more).
    Characters the tokenizer drops break the bound (SmolLM2's has no token for some
    control bytes): text made almost only of those can be refused though it fits, a
    400 for input no client means to send."""
    return max_context_len * max(map(len, vocabulary), default=1)


def check_prompt_chars(text: str, limits: RequestLimits, max_context_len: int, param: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise APIError(400, f"{param} has {len(text)} characters, more than any text that fits this model's "
                            f"maximum context length of {max_context_len} tokens ({limits.max_prompt_chars} "
                            "characters at most)", param=param, code="context_length_exceeded")


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
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise APIError(400, "max_tokens must be >= 1, or 0 with echo (to score the prompt)", param="max_tokens")
        # The engine always samples one token; the server drops it (CompletionServing).
        max_tokens = 1
    params = sampling_params(req, limits, max_tokens=max_tokens, logprobs=req.logprobs, logprobs_param="logprobs")
    if req.echo and req.logprobs is not None:
        # Echoed prompts carry their tokens' logprobs too, as OpenAI's legacy API did.
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    return params


def chat_sampling_params(req: ChatCompletionRequest, limits: RequestLimits) -> SamplingParams:
    """Params with max_tokens None when the client gave none (the server fills in the room left)."""
    if req.chat_template is not None:
        raise APIError(400, "chat_template is not accepted from requests; the server uses the model's template",
                       param="chat_template")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, limits, max_tokens=max_tokens, logprobs=logprobs, logprobs_param="top_logprobs")
    if req.prompt_logprobs is not None:
        if req.stream:
            # As in vLLM: a streamed reply has no top-level field to carry them.
            raise APIError(400, "prompt_logprobs is not supported with stream", param="prompt_logprobs")
        if req.prompt_logprobs > limits.max_logprobs:
            raise APIError(400, f"prompt_logprobs must be at most {limits.max_logprobs} on this server, got "
                                f"{req.prompt_logprobs}", param="prompt_logprobs")
        params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
    return params

