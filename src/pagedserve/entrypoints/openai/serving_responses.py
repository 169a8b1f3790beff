"""POST /v1/responses: OpenAI's Responses API over the chat path, stateless.

A request becomes a chat request (input items -> messages, `instructions` -> a system
message first, `text.format` -> response_format, flat function tools -> chat tools),
so sampling, tools, structured output and reasoning behave as on /v1/chat/completions.
A reasoning model's reasoning comes as a `reasoning` output item before the message
(its text in `content`, `summary` empty: nothing summarises it), counted in
usage.output_tokens_details.reasoning_tokens; `reasoning.effort` is chat's
reasoning_effort (docs/reasoning.md).

Nothing is stored: every response says `"store": false`, `previous_response_id`
gets a 400 (there is no earlier response to continue; send the whole conversation
as `input`), and GET/DELETE /v1/responses/{id} do not exist.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, RequestStream
from ...http.disconnect import until_disconnected
from ...http.errors import APIError
from ...http.json_body import validation_error
from ...http.openai_bodies import ChatCompletionRequest, ResponsesRequest
from ...http.reply import ReplyParser, parse_reply
from ...http.tool_parsers import ToolCall, ToolCallDelta
from ...http.tools import ToolPlan
from .serving import ChoiceTracker, SSEResponse, collect, engine_error
from .serving_chat import ChatServing, Started

# Chat field -> the Responses field a client wrote, for errors found on the chat side.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
           "reasoning_effort": "reasoning"}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req`; 400s name the Responses field."""
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "whole conversation as input", param="previous_response_id")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += _messages(req.input)
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [_chat_tool(tool, i) for i, tool in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text), "priority": req.priority,
        "reasoning_effort": _effort(req.reasoning), "thinking_token_budget": req.thinking_token_budget,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None


def _effort(reasoning: dict[str, Any] | None) -> Any:
    """reasoning.effort (chat's reasoning_effort checks it); summary is accepted and has no effect."""
    if reasoning is None:
        return None
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise APIError(400, f"reasoning takes effort and summary, got {', '.join(sorted(unknown))}", param="reasoning")
    return reasoning.get("effort")


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                               param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            # Consecutive calls belong to one assistant turn, as a chat model writes them.
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls"):
                previous["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: templates leave it out of the prompt
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise APIError(400, f"input[{i}].output must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise APIError(400, f"input[{i}].type {kind!r} is not supported (message, function_call, "
                                "function_call_output and reasoning are)", param="input")
    return messages


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Message content: a string, or parts (input_text / output_text as chat's text parts,
    input_image as chat's image_url part)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [_part(part, f"{where}[{j}]") for j, part in enumerate(content)]
    raise APIError(400, f"{where} must be a string or a list of input_text and input_image parts",
                   param="input")


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise APIError(400, f"{where}.file_id is not supported (this server stores no files): send the image "
                                "as image_url", param="input")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise APIError(400, f"{where}.image_url must be a data: URL or an http(s) URL", param="input")
        image = {"url": url, **({"detail": part["detail"]} if part.get("detail") is not None else {})}
        return {"type": "image_url", "image_url": image}
    raise APIError(400, f"{where} must be an input_text part ({{type, text}}) or an input_image part "
                        f"({{type, image_url}}), got type {kind!r}", param="input")


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """Responses' flat {"type": "function", "name", ...} as chat's {"type", "function": {...}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"tools[{index}].type {kind!r} is not supported (function tools are)", param="tools")
    return {"type": "function",
            "function": {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format ({"type": "json_schema", "name", "schema", ...}) in chat's response_format shape."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


@dataclass(slots=True)
class _Output:
    """The response's output items as they are built: reasoning, text message and function calls."""

    text: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    reasoning_tokens: int = 0
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")

    def items(self, status: str) -> list[dict[str, Any]]:
        out = []
        if self.reasoning:
            out.append(_reasoning_item(self.reasoning_id, "".join(self.reasoning), status))
        if self.text:
            out.append(_message_item(self.message_id, "".join(self.text), status))
        out += [_call_item(call, status) for call in self.calls]
        return out


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


class ResponsesServing(ChatServing):
    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, ResponsesRequest, "resp")
        try:
            chat = chat_request(req)
            params, plan = await self.prepare(chat)
        except APIError as e:
            e.param = _PARAMS.get(e.param or "", e.param)
            raise
        response_id = meta.id
        envelope = {
            "id": response_id, "object": "response", "created_at": meta.created, "model": meta.model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls, "text": req.text or {"format": {"type": "text"}},
            "store": False, "previous_response_id": None, "metadata": req.metadata or {},
            "truncation": "disabled", "error": None, "incomplete_details": None, "reasoning": req.reasoning,
        }
        with self.admission.admit(1) as seat:
            try:
                started = await self.submit(chat, params, plan, response_id, arrival, seat)
            except APIError as e:  # the images', the context's: named as the Responses fields
                e.param = _PARAMS.get(e.param or "", e.param)
                raise
            tracker = ChoiceTracker([response_id], 1, started.num_prompt_tokens, keep_output=True)
            if req.stream:
                parser = ReplyParser(started.reasoning, plan.tools.parser)
                return SSEResponse(self._response_events(started.stream, tracker, envelope, parser), seat)
            return await until_disconnected(request, self._response(started, tracker, envelope, plan.tools))

    async def _response(self, started: Started, tracker: ChoiceTracker, envelope: dict[str, Any],
                        plan: ToolPlan) -> Response:
        await collect(started.stream, tracker)
        reply = parse_reply(tracker.pieces(0), started.reasoning, plan.parser)
        output = _Output(calls=reply.calls, reasoning_tokens=reply.reasoning_tokens)
        if reply.reasoning:
            output.reasoning.append(reply.reasoning)
        if reply.content:
            output.text.append(reply.content)
        return JSONResponse(_finished(envelope, output, tracker.choices[0].finish_reason, tracker))

    async def _response_events(self, stream: RequestStream, tracker: ChoiceTracker, envelope: dict[str, Any],
                               parser: ReplyParser) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.send("response.created", response={**envelope, "status": "in_progress", "output": []})
        yield events.send("response.in_progress", response={**envelope, "status": "in_progress", "output": []})
        output = _Output()
        items = _StreamedItems(events, output)
        finish_reason = None
        try:
            async for delta in stream:
                for _, sample in tracker.update(delta):
                    last = sample.finish_reason is not None
                    parsed = parser.feed(sample.text, len(sample.token_ids), last)
                    if last:
                        finish_reason = sample.finish_reason
                    chunk = "".join([*items.reasoning(parsed.reasoning), *items.text(parsed.content),
                                     *items.calls(parsed.tool_calls)])
                    if chunk:
                        yield chunk
        except EngineDeadError as e:
            error = engine_error(e)
            yield events.send("error", code=error.code, message=error.message, param=None)
            return
        output.reasoning_tokens = parser.reasoning_tokens
        yield "".join(items.close())
        yield events.send("response.completed", response=_finished(envelope, output, finish_reason, tracker))


def _finished(envelope: dict[str, Any], output: _Output, finish_reason: str | None,
              tracker: ChoiceTracker) -> dict[str, Any]:
    usage = tracker.usage()
    incomplete = finish_reason == "length"
    return {
        **envelope, "status": "incomplete" if incomplete else "completed", "output": output.items("completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": output.reasoning_tokens},
                  "total_tokens": usage["total_tokens"]},
    }


class _EventWriter:
    """Server-sent events as the Responses API frames them: `event:` names and sequence numbers."""

    def __init__(self) -> None:
        self._sequence = 0

    def send(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _StreamedItems:
    """Opens, fills and closes output items as text and call pieces arrive."""

    def __init__(self, events: _EventWriter, output: _Output):
        self._events, self._output = events, output
        self._message_index: int | None = None  # the text message's output index, once opened
        self._reasoning_index: int | None = None  # the reasoning item's, once opened
        self._reasoning_open = False
        self._call_index: dict[int, int] = {}  # call number -> output index
        self._num_items = 0

    def reasoning(self, piece: str) -> list[str]:
        if not piece:
            return []
        out = []
        ids = {"item_id": self._output.reasoning_id, "content_index": 0}
        if self._reasoning_index is None:
            self._reasoning_index = self._num_items
            self._reasoning_open = True
            self._num_items += 1
            out.append(self._events.send("response.output_item.added", output_index=self._reasoning_index,
                                         item=_reasoning_item(self._output.reasoning_id, None, "in_progress")))
            out.append(self._events.send("response.content_part.added", output_index=self._reasoning_index, **ids,
                                         part={"type": "reasoning_text", "text": ""}))
        self._output.reasoning.append(piece)
        out.append(self._events.send("response.reasoning_text.delta", output_index=self._reasoning_index, **ids,
                                     delta=piece))
        return out

    def _close_reasoning(self) -> list[str]:
        """The reasoning item's done events, once: when the answer starts or the response ends."""
        if not self._reasoning_open:
            return []
        self._reasoning_open = False
        text = "".join(self._output.reasoning)
        ids = {"item_id": self._output.reasoning_id, "output_index": self._reasoning_index, "content_index": 0}
        return [self._events.send("response.reasoning_text.done", **ids, text=text),
                self._events.send("response.content_part.done", **ids, part={"type": "reasoning_text", "text": text}),
                self._events.send("response.output_item.done", output_index=self._reasoning_index,
                                  item=_reasoning_item(self._output.reasoning_id, text, "completed"))]

    def text(self, piece: str) -> list[str]:
        if not piece:
            return []
        out = self._close_reasoning()
        ids = {"item_id": self._output.message_id, "content_index": 0}
        if self._message_index is None:
            self._message_index = self._num_items
            self._num_items += 1
            out.append(self._events.send("response.output_item.added", output_index=self._message_index,
                                         item=_message_item(self._output.message_id, None, "in_progress")))
            out.append(self._events.send("response.content_part.added", output_index=self._message_index, **ids,
                                         part={"type": "output_text", "text": "", "annotations": []}))
        self._output.text.append(piece)
        out.append(self._events.send("response.output_text.delta", output_index=self._message_index, **ids,
                                     delta=piece, logprobs=[]))
        return out

    def calls(self, pieces: list[ToolCallDelta]) -> list[str]:
        out = self._close_reasoning() if pieces else []
        for piece in pieces:
            if piece.id is not None:
                self._call_index[piece.index] = self._num_items
                self._num_items += 1
                call = ToolCall(piece.id, piece.name or "", "")
                self._output.calls.append(call)
                out.append(self._events.send("response.output_item.added", output_index=self._num_items - 1,
                                             item=_call_item(call, "in_progress")))
            call = self._output.calls[piece.index]
            call.arguments += piece.arguments
            if piece.arguments:
                out.append(self._events.send("response.function_call_arguments.delta",
                                             output_index=self._call_index[piece.index],
                                             item_id=_call_item(call, "")["id"], delta=piece.arguments))
        return out

    def close(self) -> list[str]:
        out = self._close_reasoning()
        if self._message_index is not None:
            text = "".join(self._output.text)
            ids = {"item_id": self._output.message_id, "output_index": self._message_index, "content_index": 0}
            out.append(self._events.send("response.output_text.done", **ids, text=text, logprobs=[]))
            out.append(self._events.send("response.content_part.done", **ids,
                                         part={"type": "output_text", "text": text, "annotations": []}))
            out.append(self._events.send("response.output_item.done", output_index=self._message_index,
                                         item=_message_item(self._output.message_id, text, "completed")))
        for number, index in self._call_index.items():
            call = self._output.calls[number]
            item = _call_item(call, "completed")
            out.append(self._events.send("response.function_call_arguments.done", output_index=index,
                                         item_id=item["id"], arguments=call.arguments))
            out.append(self._events.send("response.output_item.done", output_index=index, item=item))
        return out
