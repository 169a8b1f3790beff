"""POST /api/chat and /api/generate: Ollama's generation API over the chat path.

A request becomes a chat request (`options` -> chat's sampling fields, `format` ->
response_format, `think` -> the template's enable_thinking or a thinking budget,
`tools` as they are, /api/generate's `system` and `prompt` -> two turns), so the
template, sampling, tool calls, structured output and admission are the chat
endpoint's, and its errors come back under the names the Ollama client wrote. A raw
/api/generate prompt is tokenised as it is, without the template. Replies stream as
NDJSON by default (`stream: false` answers one object), each line Ollama's shape, the
last one with `done: true`, the done_reason and the counts and durations in
nanoseconds (docs/ollama.md).
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest
from ...http.disconnect import until_disconnected
from ...http.errors import APIError
from ...http.json_body import M, parse_body, validation_error
from ...http.ollama_bodies import CHAT_TO_OLLAMA_NAMES, OllamaChatRequest, OllamaGenerateRequest, OllamaMessage, \
    format_field, keep_alive_seconds, sampling_options, think_fields
from ...http.openai_bodies import ChatCompletionRequest
from ...http.reply import ReplyParser, parse_reply
from ...http.tool_parsers import ToolCall, ToolCallDelta
from ...sampling_params import SamplingParams
from .ollama_models import iso_time
from .protocol import check_prompt_chars
from .serving import ChoiceTracker, Seat, SSEResponse, engine_error
from .serving_chat import ChatPlan, ChatServing, Started

T = TypeVar("T")
NDJSON = "application/x-ndjson"
# A request's options.num_ctx: its own context window, read where the chat path checks the room left.
_NUM_CTX: ContextVar[int | None] = ContextVar("ollama_num_ctx", default=None)
_NS = 1_000_000_000


def ndjson(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


@dataclass(slots=True)
class _Clock:
    """A reply's times, for Ollama's durations: arrival, first generated token, end."""

    arrival: float
    first: float | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def stats(self, num_prompt_tokens: int, num_tokens: int) -> dict[str, int]:
        end = time.monotonic()
        first = end if self.first is None else self.first
        return {"total_duration": int((end - self.arrival) * _NS), "load_duration": 0,
                "prompt_eval_count": num_prompt_tokens, "prompt_eval_duration": int((first - self.arrival) * _NS),
                "eval_count": num_tokens, "eval_duration": int((end - first) * _NS)}


@dataclass(frozen=True, slots=True)
class _Shape:
    """Which route's shape a reply takes: chat's `message`, or generate's `response`."""

    model: str
    chat: bool
    thinking: bool  # the reply's reasoning goes in `thinking` (think was not false)

    def envelope(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": iso_time(time.time())}

    def body(self, content: str, reasoning: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
        thinking = {"thinking": reasoning} if self.thinking and reasoning else {}
        if not self.chat:
            return {"response": content, **thinking}
        message: dict[str, Any] = {"role": "assistant", "content": content, **thinking}
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


@dataclass(slots=True)
class _StreamedCalls:
    """Tool-call pieces gathered by index; Ollama sends each call whole."""

    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, pieces: list[ToolCallDelta]) -> None:
        for piece in pieces:
            if piece.index not in self.calls:
                self.calls[piece.index] = ToolCall(piece.id or "", piece.name or "", "")
            self.calls[piece.index].arguments += piece.arguments


def ollama_call(call: ToolCall, index: int) -> dict[str, Any]:
    """A parsed call in Ollama's shape: arguments as an object."""
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": json.loads(call.arguments)}}


def renamed(error: APIError) -> APIError:
    """A chat-path error under the names an Ollama client wrote (options.num_predict, format, ...)."""
    names = {**CHAT_TO_OLLAMA_NAMES, **{chat: f"options.{chat}" for chat in
                                        ("temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                         "presence_penalty", "frequency_penalty")}}
    if error.param in names:
        new = names[error.param]
        error.message = re.sub(rf"(?<![\w.]){re.escape(error.param)}\b", new, error.message)
        error.param = new
    return error


class OllamaServing(ChatServing):
    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        req, model = await self._read(request, OllamaChatRequest)
        if not req.messages:  # Ollama's way to load a model: nothing to say
            return JSONResponse({"model": model, "created_at": iso_time(time.time()),
                                 "message": {"role": "assistant", "content": ""}, "done": True,
                                 "done_reason": "load"})
        messages = [_chat_message(m, i) for i, m in enumerate(req.messages)]
        chat, num_ctx = self._chat_request(req, model, messages, {"tools": req.tools})
        return await self._reply(request, chat, num_ctx, arrival, _Shape(model, True, req.think is not False))

    async def generate(self, request: Request) -> Response:
        arrival = time.monotonic()
        req, model = await self._read(request, OllamaGenerateRequest)
        for name in ("suffix", "template", "context", "images"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported on /api/generate", param=name)
        if not req.prompt:
            return JSONResponse({"model": model, "created_at": iso_time(time.time()), "response": "",
                                 "done": True, "done_reason": "load"})
        messages = [{"role": "system", "content": req.system}] * (req.system is not None)
        chat, num_ctx = self._chat_request(req, model, [*messages, {"role": "user", "content": req.prompt}], {})
        shape = _Shape(model, False, req.think is not False)
        if req.raw:
            if isinstance(req.think, str):
                raise APIError(400, "think levels cap the thinking the chat template opens; a raw prompt has no "
                                    "template", param="think")
            return await self._reply(request, chat, num_ctx, arrival, shape, req.prompt)
        return await self._reply(request, chat, num_ctx, arrival, shape)

    async def _read(self, request: Request, model: type[M]) -> tuple[M, str]:
        """The body, and the served model it names (404 for another); 400 for a field this server refuses."""
        req = parse_body(await request.body(), model)
        name = self.resolve_model(req.model)
        keep_alive_seconds(req.keep_alive)
        if req.logprobs or req.top_logprobs:
            raise APIError(400, "logprobs are not supported on Ollama's routes (use /v1/chat/completions)",
                           param="logprobs")
        if req.think and self.reasoning_parser is None:
            raise APIError(400, f"{name!r} does not support thinking: this server splits no reasoning "
                                "(start it with --reasoning-parser)", param="think")
        return req, name

    def _chat_request(self, req: OllamaChatRequest | OllamaGenerateRequest, model: str, messages: list[dict[str, Any]],
                      extra: dict[str, Any]) -> tuple[ChatCompletionRequest, int | None]:
        """The chat request that answers `req`, and its num_ctx."""
        sampling = sampling_options(req.options, self.engine.max_context_len)
        fields = {"model": model, "messages": messages, **sampling.chat_fields, **think_fields(req.think),
                  "response_format": format_field(req.format), "stream": req.stream, **extra}
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            raise renamed(validation_error(e)) from None
        return chat, sampling.num_ctx

    def room_for_output(self, num_prompt_tokens: int, max_tokens: int | None, *, prompt_param: str = "prompt",
                        max_tokens_param: str = "max_tokens") -> int:
        """The chat path's check, then the request's own num_ctx: generation stops where that window is full."""
        room = super().room_for_output(num_prompt_tokens, max_tokens, prompt_param=prompt_param,
                                       max_tokens_param=max_tokens_param)
        num_ctx = _NUM_CTX.get()
        if num_ctx is None:
            return room
        if num_prompt_tokens >= num_ctx:
            raise APIError(400, f"options.num_ctx is {num_ctx} tokens, but the prompt has {num_prompt_tokens} "
                                "tokens, which leaves no room to generate", param="options.num_ctx",
                           code="context_length_exceeded")
        return min(room, num_ctx - num_prompt_tokens)

    async def _reply(self, request: Request, chat: ChatCompletionRequest, num_ctx: int | None, arrival: float,
                     shape: _Shape, raw_prompt: str | None = None) -> Response:
        """Generate the reply to `chat` (`raw_prompt`: that text as it is, not the rendered chat)."""
        token = _NUM_CTX.set(num_ctx)
        try:
            params, plan = await _ollama_names(self.prepare(chat))
            request_id = f"ollama-{uuid.uuid4().hex}"
            with self.admission.admit(1) as seat:
                if raw_prompt is None:
                    begin = self.submit(chat, params, plan, request_id, arrival, seat)
                else:
                    begin = self._submit_raw(raw_prompt, chat, params, request_id, arrival, seat)
                started = await _ollama_names(begin)
                tracker = ChoiceTracker([request_id], 1, started.num_prompt_tokens, keep_output=not chat.stream)
                clock = _Clock(arrival)
                if chat.stream:
                    parser = ReplyParser(started.reasoning, plan.tools.parser)
                    return SSEResponse(self._lines(started, tracker, parser, shape, clock), seat, NDJSON)
                return await until_disconnected(request, self._whole(started, tracker, plan, shape, clock))
        finally:
            _NUM_CTX.reset(token)

    async def _submit_raw(self, prompt: str, chat: ChatCompletionRequest, params: SamplingParams, request_id: str,
                          arrival: float, seat: Seat) -> Started:
        """Start generating from `prompt` as it is: no template, no reasoning split."""
        def encode() -> list[int]:
            check_prompt_chars(prompt, self.limits, self.engine.max_context_len, "prompt")
            return self.tokenizer.encode(prompt)

        token_ids = await self.off_loop(encode)
        await self.compile_constraint(params, "format")
        params = dataclasses.replace(params, max_tokens=self.room_for_output(len(token_ids), params.max_tokens))
        stream = await self.start(seat, [GenerationRequest(request_id, token_ids, params, arrival,
                                                           lora_name=self.lora_of(chat.model))])
        return Started(stream, params, len(token_ids), None)

    async def _whole(self, started: Started, tracker: ChoiceTracker, plan: ChatPlan, shape: _Shape,
                     clock: _Clock) -> Response:
        try:
            async for delta in started.stream:
                clock.tick()
                tracker.update(delta)
        except EngineDeadError as e:
            raise engine_error(e) from None
        choice = tracker.choices[0]
        reply = parse_reply(tracker.pieces(0), started.reasoning, plan.tools.parser)
        calls = [ollama_call(call, i) for i, call in enumerate(reply.calls)]
        return JSONResponse({**shape.envelope(), **shape.body(reply.content or "", reply.reasoning, calls),
                             "done": True, "done_reason": choice.finish_reason,
                             **clock.stats(tracker.num_prompt_tokens, choice.num_tokens)})

    async def _lines(self, started: Started, tracker: ChoiceTracker, parser: ReplyParser, shape: _Shape,
                     clock: _Clock) -> AsyncIterator[str]:
        calls = _StreamedCalls()
        try:
            async for delta in started.stream:
                clock.tick()
                for _, sample in tracker.update(delta):
                    parsed = parser.feed(sample.text, len(sample.token_ids), sample.finish_reason is not None)
                    calls.add(parsed.tool_calls)
                    if parsed.content or (shape.thinking and parsed.reasoning):
                        yield ndjson({**shape.envelope(), **shape.body(parsed.content, parsed.reasoning, []),
                                      "done": False})
        except EngineDeadError as e:
            yield ndjson({"error": engine_error(e).message})
            return
        if calls.calls:
            done_calls = [ollama_call(call, i) for i, call in sorted(calls.calls.items())]
            yield ndjson({**shape.envelope(), **shape.body("", None, done_calls), "done": False})
        choice = tracker.choices[0]
        yield ndjson({**shape.envelope(), **shape.body("", None, []), "done": True,
                      "done_reason": choice.finish_reason,
                      **clock.stats(tracker.num_prompt_tokens, choice.num_tokens)})


async def _ollama_names(work: Awaitable[T]) -> T:
    """`work`'s result; its 400s name the fields an Ollama client wrote."""
    try:
        return await work
    except APIError as e:
        raise renamed(e) from None


def _chat_message(message: OllamaMessage, index: int) -> dict[str, Any]:
    """An Ollama message as a chat message: calls with their arguments, a tool result with its tool's name."""
    if message.images:
        raise APIError(400, f"messages[{index}].images: images are not supported by this server's Ollama routes",
                       param="messages")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id or f"call_{index}_{j}", "type": "function",
                              "function": {"name": call.function.name, "arguments": call.function.arguments}}
                             for j, call in enumerate(message.tool_calls)]
    if message.tool_name is not None:
        out["name"] = message.tool_name
    return out

