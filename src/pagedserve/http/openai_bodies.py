"""The OpenAI request bodies: strict models that are both the parser and the published
schema (/openapi.json), and a completion prompt's forms.

Every bound a field declares here is enforced by pydantic and appears in the document,
so the two cannot disagree. Bounds that depend on the model or on server flags (the
context length, the vocabulary, --max-n, --max-logprobs) are checked after parsing
(entrypoints/openai/protocol.py) and named in the field descriptions.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, WithJsonSchema

from ..core.validation import is_int
from ..sampling_params import MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_LOGPROBS, MAX_THINKING_TOKEN_BUDGET
from .errors import APIError
from .json_body import StrictModel

MAX_STOP_STRINGS = 16
# Each stop string is searched for in the new text of every step; a bound keeps that cheap.
MAX_STOP_STRING_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 1024
# A constraint's text (schema, regex, grammar, choices) is compiled on every cache miss;
# beyond this size it is refused before compiling (the compile timeout catches the rest).
MAX_CONSTRAINT_CHARS = 64 * 1024

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
StopStrings = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
                         Field(max_length=MAX_STOP_STRINGS)]
_ConstraintText = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
ThinkingTokenBudget = Annotated[int, Field(ge=0, le=MAX_THINKING_TOKEN_BUDGET, description=(
    "vLLM's: at most this many tokens of reasoning, then the model answers; needs a reasoning model "
    "(--reasoning-parser). 0: no reasoning."))]


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationBody(StrictModel):
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
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)] | StopStrings | None = None
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
    thinking_token_budget: ThinkingTokenBudget | None = None
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


# OpenAI's prompt forms (completion_prompts parses them): also /v1/embeddings' input.
PROMPT_FORMS = [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1,
     "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
]
_PROMPT_SCHEMA = {
    "description": "A string, a list of strings, a list of token ids, or a list of token-id lists; each prompt "
                   "non-empty, token ids below the vocabulary size, prompt tokens plus max_tokens within the "
                   "context length, at most --max-queued-requests prompts.",
    "anyOf": PROMPT_FORMS,
}


class CompletionRequest(GenerationBody):
    # Checked by `completion_prompts`, whose messages say which form was wrong; the schema says the same.
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: Annotated[int, Field(ge=0, description="Default 16; 0 only with echo (scores the prompt).")] | None = None
    logprobs: _Logprobs | None = Field(None, description="At most --max-logprobs.")
    echo: bool = False
    best_of: int | None = Field(None, description="Only n itself is supported.")
    # Beam search (vLLM's extension; scored as transformers' generate(num_beams=...)).
    use_beam_search: bool = Field(False, description="Beam search: the n best of beam_width beams; temperature 0 "
                                                     "(the default then), no stream, stop strings, logprobs, "
                                                     "penalties, filters or structured output.")
    beam_width: Annotated[int, Field(ge=1, description="Beams kept each step; default n, at most --max-n; "
                                                       "only with use_beam_search.")] | None = None
    length_penalty: Annotated[float, Field(allow_inf_nan=False, description=(
        "A finished beam scores its summed logprob / generated tokens ** length_penalty (default 1); only with "
        "use_beam_search."))] | None = None
    early_stopping: bool | Literal["never"] | None = Field(None, description=(
        "transformers' meaning: true stops once beam_width beams finished, false (default) once no running beam "
        "can do better, \"never\" bounds that at max_tokens; only with use_beam_search."))
    suffix: Annotated[str, Field(max_length=0, description="Not supported: must be empty.")] | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str = Field(min_length=1, description="A data: URL (base64), or an http(s) URL on a host "
                                               "--allowed-media-domains lists (docs/images.md).")
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="Accepted; the model's image processor decides the resolution either way.")


class ImageURLPart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class ChatMessage(StrictModel):
    role: str = Field(min_length=1, description="system, user, assistant, or another role the chat template knows.")
    # The list first: its errors (a part of an unknown type, a bad image_url) are the ones worth reporting.
    content: list[ContentPart] | str | None = Field(
        None, description="Text, or text and image_url parts (images need a vision model; at most "
                          "--limit-mm-per-prompt per request).")
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


class ChatCompletionRequest(GenerationBody):
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
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="A thinking budget of 1024 / 4096 / 16384 tokens (at most max_tokens); not with "
                          "thinking_token_budget.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the chat template, e.g. {\"enable_thinking\": false} "
                          "(templates that do not read one ignore it).")

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


class TokenizeRequest(StrictModel):
    """Exactly one of prompt and messages."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    # Not nullable, so that "exactly one given" is what the schema's oneOf says.
    prompt: str = None  # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[_TokenId] = Field(description="Token ids below the vocabulary size.")


# POST /v1/responses (entrypoints/openai/serving_responses.py turns it into a chat request).
class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None  # accepted; nothing is ever stored
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = Field(
        None, description="{effort: low | medium | high}: a thinking budget as chat's reasoning_effort; "
                          "summary is accepted (the reasoning item carries the reasoning itself).")
    thinking_token_budget: ThinkingTokenBudget | None = None
    # As on chat/completions (a vLLM extra); a tenant's key may fix it (docs/tenants.md).
    priority: int = Field(0, description="Lower runs first under --scheduling-policy priority.")


Prompt = str | list[int]


def completion_prompts(prompt: Any, param: str = "prompt") -> list[Prompt]:
    """OpenAI's prompt forms as a list: one text, texts, one token-id list, or several
    (`param`: the field they came in, for the error)."""
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
        raise APIError(400, f"{param} is required", param=param)
    raise APIError(
        400, f"{param} must be a non-empty string, a list of strings, a list of token ids or a list of token-id lists",
        param=param,
    )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise APIError(400, f"{param} contains token id {bad}, outside the vocabulary [0, {vocab_size - 1}]",
                       param=param)
