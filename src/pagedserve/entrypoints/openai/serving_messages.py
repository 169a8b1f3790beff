"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request becomes a chat request (`system` -> a leading system message, tool_use blocks ->
the assistant's tool_calls, tool_result blocks -> tool messages, `tools` / `tool_choice` /
`stop_sequences` / `output_config.format` -> chat's, a final assistant turn -> text after
the generation prompt), so the template, sampling, stop strings, tool calls, structured
output and admission are the chat endpoint's. The reply becomes a message of text and
tool_use blocks (after a thinking block, when the request enables thinking), or
Anthropic's event stream. Errors on these routes take Anthropic's shape
(http/errors.py), the key comes as x-api-key or a bearer token (middleware.py), and
the anthropic-version header is accepted whatever it says.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, RequestStream
from ...http.anthropic_bodies import STREAM_EVENTS, AnthropicErrorResponse, ContentBlockParam, CountTokensRequest, \
    CountTokensResponse, ImageBlockParam, Message, MessagesPrompt, MessagesRequest, OutputConfig, \
    RedactedThinkingBlockParam, TextBlockParam, ThinkingBlockParam, ThinkingConfigDisabled, ThinkingConfigEnabled, \
    ToolChoice, ToolChoiceAny, ToolChoiceNone, ToolChoiceTool, ToolParam, ToolResultBlockParam, ToolUseBlockParam, \
    URLImageSource
from ...http.disconnect import named_sse, until_disconnected
from ...http.errors import APIError
from ...http.json_body import StrictModel, parse_body, validation_error
from ...http.openai_bodies import ChatCompletionRequest
from ...http.openapi import anthropic_responses, post_route
from ...http.reply import ReplyParser, parse_reply
from ...http.tool_parsers import ToolCallDelta
from ...http.tools import template_messages
from ...sampling_params import SamplingParams
from .routes import ServerParts
from .serving import ChoiceTracker, SSEResponse, collect, engine_error
from .serving_chat import ChatPlan, ChatServing, Started

# Chat's field names in the errors found on the chat side -> the Messages fields they stand for.
_FIELD_NAMES = {".function.parameters": ".input_schema", "response_format": "output_config.format",
                "thinking_token_budget": "thinking.budget_tokens"}


def messages_routes(app: FastAPI, parts: ServerParts) -> list[type[StrictModel]]:
    """The Anthropic routes; returns their request models for the document."""
    messages = MessagesServing(parts.context, tool_parser=parts.tool_parser, reasoning_parser=parts.reasoning_parser)

    post_route(app, "/v1/messages", MessagesRequest, anthropic_responses(Message, AnthropicErrorResponse, STREAM_EVENTS),
               "create_message", messages.create)
    post_route(app, "/v1/messages/count_tokens", CountTokensRequest,
               anthropic_responses(CountTokensResponse, AnthropicErrorResponse), "count_message_tokens",
               messages.count_tokens)

    return [MessagesRequest, CountTokensRequest]


class MessagesServing(ChatServing):
    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, MessagesRequest, "msg")
        chat = chat_request(req, {"max_tokens": req.max_tokens, "stop": req.stop_sequences,
                                  "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                                  "response_format": _response_format(req.output_config),
                                  "priority": req.priority, **_thinking(req)})
        prefill = _prefill(req)
        params, plan = await self.checked(chat)
        message_id = f"msg_{meta.id.rpartition('-')[2]}"
        envelope = {"id": message_id, "type": "message", "role": "assistant", "model": meta.model}
        thinking = isinstance(req.thinking, ThinkingConfigEnabled)
        with self.admission.admit(1) as seat:
            started = await self.submit(chat, params, plan, message_id, arrival, seat, prefill)
            tracker = ChoiceTracker([message_id], 1, started.num_prompt_tokens, keep_output=not req.stream)
            if req.stream:
                parser = ReplyParser(started.reasoning, plan.tools.parser)
                return SSEResponse(self._events(started.stream, tracker, envelope, parser, thinking), seat)
            return await until_disconnected(request, self._message(started, tracker, envelope, plan, thinking))

    async def count_tokens(self, request: Request) -> JSONResponse:
        """The input_tokens a /v1/messages request with this prompt would have."""
        req = parse_body(await request.body(), CountTokensRequest)
        self.resolve_model(req.model)
        # The prompt /v1/messages would render: the thinking switch, but no budget (it is not the prompt's).
        thinking_off = isinstance(req.thinking, ThinkingConfigDisabled)
        chat, prefill = chat_request(req, _THINKING_OFF if thinking_off else {}), _prefill(req)
        _, plan = await self.checked(chat)
        images = await self.load_images(chat.messages, req.model)
        text, tokens = await self.off_loop(self.render_prompt, template_messages(chat.messages), True,
                                           plan.tools.tools, prefill, plan.reasoning.template_kwargs)
        return JSONResponse({"input_tokens": self.images.prompt_tokens(text, tokens, images)})

    async def checked(self, chat: ChatCompletionRequest) -> tuple[SamplingParams, ChatPlan]:
        """`prepare`, its 400s naming the fields a Messages client wrote."""
        try:
            return await self.prepare(chat)
        except APIError as e:
            for chat_name, name in _FIELD_NAMES.items():
                e.message = e.message.replace(chat_name, name)
            raise

    async def _message(self, started: Started, tracker: ChoiceTracker, envelope: dict[str, Any],
                       plan: ChatPlan, thinking: bool) -> Response:
        await collect(started.stream, tracker)
        choice = tracker.choices[0]
        reply = parse_reply(tracker.pieces(0), started.reasoning, plan.tools.parser)
        blocks = [_thinking_block(reply.reasoning)] if thinking and reply.reasoning else []
        blocks += [{"type": "text", "text": reply.content}] if reply.content else []
        blocks += [{"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                    "input": json.loads(call.arguments)} for call in reply.calls]
        return JSONResponse({**envelope, "content": blocks,
                             **_stop(choice.finish_reason, choice.stop_reason, bool(reply.calls)),
                             "usage": {"input_tokens": tracker.num_prompt_tokens, "output_tokens": choice.num_tokens}})

    async def _events(self, stream: RequestStream, tracker: ChoiceTracker, envelope: dict[str, Any],
                      parser: ReplyParser, thinking: bool) -> AsyncIterator[str]:
        usage = {"input_tokens": tracker.num_prompt_tokens, "output_tokens": 0}
        yield named_sse({"type": "message_start", "message": {**envelope, "content": [], "stop_reason": None,
                                                            "stop_sequence": None, "usage": usage}})
        blocks = _StreamedBlocks()
        choice = tracker.choices[0]
        try:
            async for delta in stream:
                for _, sample in tracker.update(delta):
                    parsed = parser.feed(sample.text, len(sample.token_ids), sample.finish_reason is not None)
                    out = blocks.thinking(parsed.reasoning) if thinking else []
                    out += blocks.text(parsed.content) + blocks.calls(parsed.tool_calls)
                    if out:
                        yield "".join(out)
        except EngineDeadError as e:
            yield named_sse(engine_error(e).anthropic_body())
            return
        try:
            stop = _stop(choice.finish_reason, choice.stop_reason, parser.num_calls > 0)
        except APIError as e:
            yield named_sse(e.anthropic_body())
            return
        yield "".join([*blocks.close(),
                       named_sse({"type": "message_delta", "delta": stop, "usage": {"output_tokens": choice.num_tokens}}),
                       named_sse({"type": "message_stop"})])


def chat_request(req: MessagesPrompt, sampling: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request that answers `req`, with the chat fields in `sampling`."""
    fields: dict[str, Any] = {
        "model": req.model, "messages": _chat_messages(req), **sampling,
        "tools": [_chat_tool(tool) for tool in req.tools] if req.tools else None,
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": not getattr(req.tool_choice, "disable_parallel_tool_use", False),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None


def _chat_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages, but for a final assistant turn (`_prefill`);
    400 for a conversation Anthropic's API refuses."""
    if req.messages[0].role != "user":
        raise APIError(400, "messages[0].role must be user: a conversation starts with a user turn")
    out = [] if req.system is None else [{"role": "system", "content": _text(req.system)}]
    calls: set[str] = set()  # the tool_use ids of the assistant turn just before
    turns = req.messages[:-1] if req.messages[-1].role == "assistant" else req.messages
    for i, message in enumerate(turns):
        if message.role == "assistant":
            out.append(_assistant(message.content, i))
            calls = {call["id"] for call in out[-1].get("tool_calls", ())}
        else:
            out += _user(message.content, i, calls)
            calls = set()
    return out


_THINKING_OFF: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}


def _thinking(req: MessagesRequest) -> dict[str, Any]:
    """`thinking` as chat fields: enabled -> the budget (Anthropic's bounds checked here),
    disabled -> the template's enable_thinking switch off."""
    if isinstance(req.thinking, ThinkingConfigDisabled):
        return _THINKING_OFF
    if not isinstance(req.thinking, ThinkingConfigEnabled):
        return {}
    if req.thinking.budget_tokens >= req.max_tokens:
        raise APIError(400, f"max_tokens must be greater than thinking.budget_tokens ({req.thinking.budget_tokens}), "
                            f"got {req.max_tokens}", param="thinking")
    return {"thinking_token_budget": req.thinking.budget_tokens}


def _thinking_block(text: str) -> dict[str, str]:
    return {"type": "thinking", "thinking": text, "signature": _signature(text)}


def _signature(text: str) -> str:
    """A stable checksum of a thinking block (Anthropic's is an opaque verification token;
    this server verifies nothing it is sent back)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _prefill(req: MessagesPrompt) -> str:
    """A final assistant turn's text: the start of the reply, which the model continues
    (the reply holds only what follows it); "" when the user spoke last."""
    last = req.messages[-1]
    if last.role == "user":
        return ""
    if isinstance(last.content, str):
        text = last.content
    elif all(isinstance(block, TextBlockParam) for block in last.content):
        text = "\n".join(block.text for block in last.content)
    else:
        raise APIError(400, "a final assistant turn (a prefill of the reply) may hold only text blocks")
    if text != text.rstrip():
        # As Anthropic's API: the reply's first token would have to start mid-whitespace.
        raise APIError(400, "final assistant content cannot end with trailing whitespace")
    return text


def _text(content: str | list[TextBlockParam | ImageBlockParam]) -> str | list[dict[str, Any]]:
    """Text (and a user turn's images) as chat content: a string, or parts."""
    return content if isinstance(content, str) else [_chat_part(block) for block in content]


def _chat_part(block: TextBlockParam | ImageBlockParam) -> dict[str, Any]:
    """A block as chat's part: an image's base64 source as a data: URL, checked as chat's are."""
    if isinstance(block, TextBlockParam):
        return {"type": "text", "text": block.text}
    source = block.source
    url = source.url if isinstance(source, URLImageSource) else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(content: str | list[ContentBlockParam], index: int) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for j, block in enumerate(content):
        if isinstance(block, ToolUseBlockParam):
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name,
                                                                           "arguments": block.input}})
        elif isinstance(block, (ThinkingBlockParam, RedactedThinkingBlockParam)):
            continue  # an earlier reply's reasoning: templates leave it out of the prompt
        elif isinstance(block, (ToolResultBlockParam, ImageBlockParam)):
            raise APIError(400, f"messages[{index}].content[{j}]: {block.type} blocks belong in user turns")
        else:
            texts.append(block)
    message: dict[str, Any] = {"role": "assistant", "content": _text(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: str | list[ContentBlockParam], index: int, calls: set[str]) -> list[dict[str, Any]]:
    """A user turn: its text, and a tool message per tool_result, in their order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[TextBlockParam | ImageBlockParam] = []
    for j, block in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(block, (ToolUseBlockParam, ThinkingBlockParam, RedactedThinkingBlockParam)):
            raise APIError(400, f"{where}: {block.type} blocks belong in assistant turns")
        if isinstance(block, (TextBlockParam, ImageBlockParam)):
            texts.append(block)
            continue
        if block.tool_use_id not in calls:
            raise APIError(400, f"{where}.tool_use_id {block.tool_use_id!r} answers no tool_use block of the "
                                "assistant turn just before it")
        if texts:
            out.append({"role": "user", "content": _text(texts)})
            texts = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
    if texts:
        out.append({"role": "user", "content": _text(texts)})
    return out


def _chat_tool(tool: ToolParam) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return "none" if isinstance(choice, ToolChoiceNone) else "auto"


def _response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    """output_config.format as chat's response_format (a JSON schema the reply follows)."""
    if config is None or config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"schema": config.format.json_schema}}


def _tool_use_id(call_id: str) -> str:
    return f"toolu_{call_id.removeprefix('call_')}"


def _stop(finish_reason: str | None, stop_reason: int | str | None, called: bool) -> dict[str, Any]:
    """Anthropic's stop_reason and stop_sequence for how generation ended; a reply the
    server aborted (it is shutting down) has none, so it is an error the client retries."""
    if finish_reason == "abort":
        raise APIError(503, "the request was aborted: the server is shutting down", code="shutting_down")
    if finish_reason == "length":
        reason = "max_tokens"
    elif called:
        reason = "tool_use"
    elif isinstance(stop_reason, str):
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": stop_reason if reason == "stop_sequence" else None}


class _StreamedBlocks:
    """Opens, fills and closes content blocks as reasoning, text and call pieces arrive:
    a thinking block while reasoning comes (its signature sent as it closes), a text
    block while text comes, a tool_use block per call."""

    def __init__(self) -> None:
        self._count = 0  # blocks started; the open one (if any) is the last
        self._open: str | None = None  # the open block's type
        self._thought: list[str] = []  # the thinking block's text so far

    def thinking(self, piece: str) -> list[str]:
        if not piece:
            return []
        out = [] if self._open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        self._thought.append(piece)
        return out + [self._delta({"type": "thinking_delta", "thinking": piece})]

    def text(self, piece: str) -> list[str]:
        if not piece:
            return []
        out = [] if self._open == "text" else self._start({"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": piece})]

    def calls(self, pieces: list[ToolCallDelta]) -> list[str]:
        out = []
        for piece in pieces:
            if piece.id is not None:
                out += self._start({"type": "tool_use", "id": _tool_use_id(piece.id), "name": piece.name or "",
                                    "input": {}})
            if piece.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return out

    def close(self) -> list[str]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature("".join(self._thought))}))
        self._open = None
        return out + [named_sse({"type": "content_block_stop", "index": self._count - 1})]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        out.append(named_sse({"type": "content_block_start", "index": self._count, "content_block": block}))
        self._open = block["type"]
        self._count += 1
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return named_sse({"type": "content_block_delta", "index": self._count - 1, "delta": delta})
