"""Anthropic's Messages API wire format: the request bodies of POST /v1/messages and
/v1/messages/count_tokens, and the shapes of what they answer (for the OpenAPI document).

As the OpenAI bodies (openai_bodies.py), the request models are strict, ignore unknown fields (`metadata`,
`cache_control`, `anthropic-beta` features) and carry Anthropic's bounds, so they
double as the published schema. What pydantic cannot check (the order of turns, which
tool_use a tool_result answers) is checked when the request becomes a chat request
(entrypoints/openai/serving_messages.py). Here, below both the server and the routers,
so a router documents and proxies the routes with the server's models.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from .json_body import StrictModel
from .openai_bodies import StopStrings

_Id = Annotated[str, Field(min_length=1)]
_DisableParallel = Annotated[bool, Field(description="At most one tool_use block in the reply.")]


class TextBlockParam(StrictModel):
    type: Literal["text"]
    text: str


class Base64ImageSource(StrictModel):
    type: Literal["base64"]
    media_type: str = Field(description="image/png, image/jpeg, image/gif, image/webp or image/bmp; the data "
                                        "must be of that format.")
    data: str = Field(description="The image's bytes, base64.")


class URLImageSource(StrictModel):
    type: Literal["url"]
    url: str = Field(min_length=1, description="An http(s) URL on a host --allowed-media-domains lists.")


class ImageBlockParam(StrictModel):
    """An image in a user turn (docs/images.md); needs a vision model."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]


class ToolUseBlockParam(StrictModel):
    """A call the assistant made, sent back in an assistant turn."""

    type: Literal["tool_use"]
    id: _Id
    name: _Id
    input: dict[str, Any]


class ToolResultBlockParam(StrictModel):
    """A call's result, in the user turn after the assistant's tool_use."""

    type: Literal["tool_result"]
    tool_use_id: _Id
    content: str | list[TextBlockParam] = ""
    is_error: bool = Field(False, description="Accepted; the model reads the content either way.")


class ThinkingBlockParam(StrictModel):
    """An earlier reply's reasoning, sent back in its assistant turn; left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlockParam(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[TextBlockParam | ImageBlockParam | ToolUseBlockParam | ToolResultBlockParam
                              | ThinkingBlockParam | RedactedThinkingBlockParam, Field(discriminator="type")]


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    # The list first: its errors (a block of an unknown type) are the ones worth reporting.
    content: Annotated[list[ContentBlockParam], Field(min_length=1)] | str


class ToolParam(StrictModel):
    """A client tool: the model calls it with an `input` valid against `input_schema`."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON schema of the call's input.")


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: _DisableParallel = False


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: _DisableParallel = False


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: _Id
    disable_parallel_tool_use: _DisableParallel = False


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class JSONOutputFormat(StrictModel):
    type: Literal["json_schema"]
    # `schema` would shadow BaseModel.schema.
    json_schema: dict[str, Any] = Field(alias="schema", description="The reply is JSON valid against it.")


class OutputConfig(StrictModel):
    format: JSONOutputFormat | None = None


class ThinkingConfigEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024, description="At least 1024 and less than max_tokens: at most this "
                                                             "many tokens of reasoning.")]


class ThinkingConfigDisabled(StrictModel):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingConfigEnabled | ThinkingConfigDisabled, Field(discriminator="type")]


class MessagesPrompt(StrictModel):
    """What makes the prompt: both routes take it."""

    # Required by Anthropic's API; optional here as on every route of this server.
    model: str | None = Field(None, description="One of the names /v1/models lists; default: the first.")
    messages: Annotated[list[MessageParam], Field(
        min_length=1, description="Starts with a user turn; a final assistant turn is the start of the reply "
                                  "(text only); a tool_result answers a tool_use of the assistant turn just "
                                  "before it.")]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = Field(None, description="Default auto when tools are given.")


class MessagesRequest(MessagesPrompt):
    max_tokens: Annotated[int, Field(ge=1, description="Prompt tokens plus max_tokens within the context.")]
    stop_sequences: StopStrings | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False, description="0 = greedy.")] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0, description="0 = off.")] | None = None
    output_config: OutputConfig | None = Field(None, description="Only `format` is used (effort is ignored).")
    thinking: ThinkingConfig | None = Field(None, description=(
        "enabled: the reply starts with a thinking block (a reasoning model's reasoning, at most budget_tokens); "
        "disabled: the chat template is asked not to think (enable_thinking false). Without it, reasoning is "
        "left out of the reply."))
    # Not Anthropic's: the scheduling priority chat/completions takes (a vLLM extra).
    priority: int = Field(0, description="Lower runs first under --scheduling-policy priority.")


class CountTokensRequest(MessagesPrompt):
    thinking: ThinkingConfig | None = Field(None, description=(
        "As /v1/messages: disabled renders the prompt with enable_thinking false, as that request would."))


# -- what the routes answer (documentation; serving_messages.py writes them) ------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="The sha256 of the thinking text, in hex: no secret, only a checksum.")


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every 4xx and 5xx body on the Anthropic routes."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# The event names of a streamed message, in Anthropic's order (and an error event).
STREAM_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop", "error")
