"""POST /v1/chat/completions: the model's own chat template, streamed or not; tool calls (http/tools.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest, RequestStream
from ...http.disconnect import sse, until_disconnected
from ...http.errors import APIError
from ...http.openai_bodies import ChatCompletionRequest
from ...http.tool_parsers import StreamingToolParser, ToolParser
from ...http.tools import ToolPlan, plan_tools, render_chat_text, template_messages, tool_chat_tokenizer
from ...model.tokenizer import Tokenizer
from ...outputs import TokenLogprobs
from ...sampling_params import SamplingParams
from ...structured_output.spec import StructuredOutputs
from .protocol import bad_request, chat_sampling_params, check_prompt_chars, structured_output_param
from .serving import (SSE_DONE, ChoiceTracker, OpenAIServing, ResponseMeta, Seat, ServingContext, SSEResponse,
                      collect, engine_failure_event, finite_logprob)


class ChatServing(OpenAIServing):
    def __init__(self, context: ServingContext, tool_parser: ToolParser | None = None):
        super().__init__(context)
        self.tool_parser = tool_parser
        self._tool_tokenizer: Tokenizer = tool_chat_tokenizer(self.tokenizer, tool_parser)

    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, ChatCompletionRequest, "chatcmpl")
        params, plan = await self.prepare(req)
        with self.admission.admit(1) as seat:
            stream, params, num_prompt_tokens = await self.submit(req, params, plan, meta.id, arrival, seat)
            tracker = ChoiceTracker([meta.id], params.n, num_prompt_tokens, keep_output=not req.stream)
            top = req.top_logprobs or 0
            if req.stream:
                return SSEResponse(self._events(stream, tracker, meta, params.n, top, req.include_usage, plan), seat)
            return await until_disconnected(request, self._respond(stream, tracker, meta, top, plan))

    async def prepare(self, req: ChatCompletionRequest) -> tuple[SamplingParams, ToolPlan]:
        """The request's sampling params and tool plan, every problem a 400."""
        params = chat_sampling_params(req, self.limits)
        plan = await self.off_loop(self.plan_tools, req)
        if plan.constraint is not None:
            constraint_param = structured_output_param(req)
            if constraint_param is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} forces a call and cannot be combined with "
                                    f"{constraint_param}", param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
        return params, plan

    async def submit(self, req: ChatCompletionRequest, params: SamplingParams, plan: ToolPlan, request_id: str,
                     arrival: float, seat: Seat, prefill: str = "") -> tuple[RequestStream, SamplingParams, int]:
        """Render, check the context and start generating: (stream, final params, prompt length)."""
        prompt_ids = await self.off_loop(self.render, template_messages(req.messages), True, plan.tools, prefill)
        await self.compile_constraint(params, structured_output_param(req) if plan.constraint is None else "tools")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.room_for_output(len(prompt_ids), params.max_tokens, prompt_param="messages",
                                          max_tokens_param=param)
        if max_tokens != params.max_tokens:
            try:
                params = dataclasses.replace(params, max_tokens=max_tokens)
            except ValueError as e:  # min_tokens beyond the room the prompt left
                raise bad_request(e) from None
        stream = await self.start(seat, [
            GenerationRequest(request_id, prompt_ids, params, arrival, req.priority, req.cache_salt,
                              req.kv_transfer_params, self.lora_of(req.model))
        ])
        return stream, params, len(prompt_ids)

    def plan_tools(self, req: ChatCompletionRequest) -> ToolPlan:
        """The request's tools checked (schemas compiled: CPU work, run in the pool)."""
        def check(constraint: StructuredOutputs) -> None:
            self.engine.engine.structured_outputs.compile(constraint)

        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser, check)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, prefill: str = "") -> list[int]:
        """The prompt's token ids; runs in the thread pool (template rendering is CPU work).
        `prefill` is the start of the reply, written after the generation prompt for the
        model to continue (Anthropic's final assistant turn)."""
        try:
            text = render_chat_text(self.tokenizer, self._tool_tokenizer, messages, add_generation_prompt, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        text += prefill
        check_prompt_chars(text, self.limits, self.engine.max_context_len, "messages")
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not token_ids:
            raise APIError(400, "messages render to an empty prompt", param="messages")
        return token_ids

    async def _respond(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta, top: int,
                       plan: ToolPlan) -> Response:
        prompt_logprobs = await collect(stream, tracker)
        choices = []
        for c in tracker.choices:
            text = "".join(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = c.finish_reason
            if plan.parser is not None:
                content, calls = plan.parser.parse(text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [call.as_openai() for call in calls]}
                    finish_reason = _tool_finish_reason(finish_reason)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": {"content": _logprobs(c.logprobs, c.token_ids, top)} if c.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })
        body = {**meta.envelope("chat.completion", choices), "usage": tracker.usage(), **tracker.kv_transfer_field()}
        if meta.id in prompt_logprobs:
            body["prompt_logprobs"] = [None if entry is None else _vllm_logprobs(entry)
                                       for entry in prompt_logprobs[meta.id]]
        return JSONResponse(body)

    async def _events(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta, n: int, top: int,
                      include_usage: bool, plan: ToolPlan) -> AsyncIterator[str]:
        chunk = "chat.completion.chunk"
        # The role first, as OpenAI does: clients see the stream is alive before the first token.
        yield "".join(sse(meta.envelope(chunk, [_chunk_choice(i, {"role": "assistant", "content": ""})]))
                      for i in range(n))
        parsers = [plan.parser.stream() for _ in range(n)] if plan.parser is not None else None
        try:
            async for delta in stream:
                events = []
                for choice, sample in tracker.update(delta):
                    message = {"content": sample.text} if sample.text else {}
                    finish_reason = sample.finish_reason
                    if parsers is not None:
                        message, finish_reason = _tool_delta(parsers[choice.index], sample.text, finish_reason)
                    if not (message or finish_reason or sample.logprobs):
                        continue  # text held back (a partial character, stop string or tool-call tag)
                    logprobs = None
                    if sample.logprobs:
                        logprobs = {"content": _logprobs(sample.logprobs, sample.token_ids, top)}
                    events.append(sse(meta.envelope(chunk, [_chunk_choice(
                        choice.index, message, logprobs, finish_reason, sample.stop_reason,
                    )])))
                if events:
                    yield "".join(events)
        except EngineDeadError as e:
            yield engine_failure_event(e)
        if include_usage:
            yield sse({**meta.envelope(chunk, []), "usage": tracker.usage()})
        yield SSE_DONE


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    """OpenAI's finish reason for a reply that made calls: "tool_calls" when it ended by itself."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _tool_delta(parser: StreamingToolParser, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A chunk's delta (content and call pieces) from the next text, and its finish reason."""
    parsed = parser.feed(text, last=finish_reason is not None)
    if finish_reason is not None and parser.num_calls:
        finish_reason = _tool_finish_reason(finish_reason)
    message: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
    if parsed.tool_calls:
        message["tool_calls"] = [piece.as_openai() for piece in parsed.tool_calls]
    return message, finish_reason


def _chunk_choice(index: int, delta: dict[str, Any], logprobs: dict | None = None, finish_reason: str | None = None,
                  stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def _vllm_logprobs(entry: TokenLogprobs) -> dict[str, dict[str, Any]]:
    """vLLM's shape for one prompt position: token id (as a JSON key) -> logprob, rank, decoded token."""
    return {str(token_id): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()}


def _logprobs(entries: Sequence[TokenLogprobs], token_ids: Sequence[int], top: int) -> list[dict[str, Any]]:
    """The chat format: each token with its logprob and the `top` most likely alternatives."""
    out = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        alternatives = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)
        out.append({**_token(chosen.decoded_token, chosen.logprob),
                    "top_logprobs": [_token(lp.decoded_token, lp.logprob) for lp in alternatives]})
    return out
