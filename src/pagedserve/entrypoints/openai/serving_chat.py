"""POST /v1/chat/completions: the model's own chat template, streamed or not; tool calls
(http/tools.py) and reasoning (http/reasoning_plan.py, docs/reasoning.md)."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest, RequestStream
from ...http.disconnect import sse, until_disconnected
from ...http.errors import APIError
from ...http.openai_bodies import ChatCompletionRequest
from ...http.reasoning_plan import ReasoningPlan, plan_reasoning
from ...http.reasoning_parsers import PromptReasoning, ReasoningFormat
from ...http.reply import ReplyParser, parse_reply
from ...http.tool_parsers import ToolParser
from ...http.tools import ToolPlan, plan_tools, render_chat_text, template_messages, tool_chat_tokenizer
from ...model.tokenizer import Tokenizer
from ...outputs import TokenLogprobs
from ...sampling_params import SamplingParams
from ...structured_output.spec import StructuredOutputs
from .protocol import bad_request, chat_sampling_params, check_prompt_chars, structured_output_param
from .serving import (SSE_DONE, ChoiceTracker, OpenAIServing, ResponseMeta, Seat, ServingContext, SSEResponse,
                      collect, engine_failure_event, finite_logprob)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What the server does with a chat request's tools and reasoning."""

    tools: ToolPlan
    reasoning: ReasoningPlan


@dataclass(frozen=True, slots=True)
class Started:
    """A chat request handed to the engine."""

    stream: RequestStream
    params: SamplingParams  # as submitted (max_tokens filled in, the thinking budget resolved)
    num_prompt_tokens: int
    reasoning: PromptReasoning | None  # how its replies split (None: not at all)


class ChatServing(OpenAIServing):
    def __init__(self, context: ServingContext, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningFormat | None = None):
        super().__init__(context)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._tool_tokenizer: Tokenizer = tool_chat_tokenizer(self.tokenizer, tool_parser)

    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, ChatCompletionRequest, "chatcmpl")
        params, plan = await self.prepare(req)
        with self.admission.admit(1) as seat:
            started = await self.submit(req, params, plan, meta.id, arrival, seat)
            n = started.params.n
            tracker = ChoiceTracker([meta.id], n, started.num_prompt_tokens, keep_output=not req.stream)
            top = req.top_logprobs or 0
            if req.stream:
                parsers = [ReplyParser(started.reasoning, plan.tools.parser) for _ in range(n)]
                return SSEResponse(self._events(started.stream, tracker, meta, top, req.include_usage, parsers),
                                   seat)
            return await until_disconnected(request, self._respond(started, tracker, meta, top, plan.tools))

    async def prepare(self, req: ChatCompletionRequest) -> tuple[SamplingParams, ChatPlan]:
        """The request's sampling params, tool plan and reasoning plan, every problem a 400."""
        params = chat_sampling_params(req, self.limits)
        reasoning = plan_reasoning(self.reasoning_parser, budget=req.thinking_token_budget,
                                   effort=req.reasoning_effort, template_kwargs=req.chat_template_kwargs)
        plan = await self.off_loop(self.plan_tools, req)
        if plan.constraint is not None:
            constraint_param = structured_output_param(req)
            if constraint_param is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} forces a call and cannot be combined with "
                                    f"{constraint_param}", param="tool_choice")
            if self.reasoning_parser is not None and self.reasoning_parser.reads_calls:
                raise APIError(400, f"tool_choice {req.tool_choice!r} forces a call, which this server does not do "
                                    f"for {self.reasoning_parser.name} models (docs/harmony.md): use 'auto'",
                               param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
        if self.reasoning_parser is not None and self.reasoning_parser.special_markers:
            # The parser reads the format's special-token markers out of the text.
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params, ChatPlan(plan, reasoning)

    async def submit(self, req: ChatCompletionRequest, params: SamplingParams, plan: ChatPlan, request_id: str,
                     arrival: float, seat: Seat, prefill: str = "") -> Started:
        """Load the images, render, check the context and start generating."""
        images = await self.load_images(req.messages, req.model)
        text, prompt_ids = await self.off_loop(self.render_prompt, template_messages(req.messages), True,
                                               plan.tools.tools, prefill, plan.reasoning.template_kwargs)
        num_prompt_tokens = self.images.prompt_tokens(text, prompt_ids, images)
        tools = plan.tools
        await self.compile_constraint(params, structured_output_param(req) if tools.constraint is None else "tools")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.room_for_output(num_prompt_tokens, params.max_tokens, prompt_param="messages",
                                          max_tokens_param=param)
        if max_tokens != params.max_tokens:
            try:
                params = dataclasses.replace(params, max_tokens=max_tokens)
            except ValueError as e:  # min_tokens beyond the room the prompt left
                raise bad_request(e) from None
        reasoning = plan.reasoning.for_prompt(text)
        params = plan.reasoning.apply(params, reasoning, self.encode_marker, split_reply=True)
        stream = await self.start(seat, [
            GenerationRequest(request_id, prompt_ids, params, arrival, req.priority, req.cache_salt,
                              req.kv_transfer_params, self.lora_of(req.model), images=tuple(images))
        ])
        return Started(stream, params, num_prompt_tokens, reasoning)

    def plan_tools(self, req: ChatCompletionRequest) -> ToolPlan:
        """The request's tools checked (schemas compiled: CPU work, run in the pool)."""
        def check(constraint: StructuredOutputs) -> None:
            self.engine.engine.structured_outputs.compile(constraint)

        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser, check)

    def render_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[dict[str, Any]] | None = None, prefill: str = "",
                      template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The prompt's text and token ids; runs in the thread pool (template rendering is
        CPU work). `prefill` is the start of the reply, written after the generation prompt
        for the model to continue (Anthropic's final assistant turn); `template_kwargs` are
        the request's chat_template_kwargs."""
        try:
            text = render_chat_text(self.tokenizer, self._tool_tokenizer, messages, add_generation_prompt, tools,
                                    template_kwargs, self.images.placeholder)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        text += prefill
        check_prompt_chars(text, self.limits, self.engine.max_context_len, "messages")
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not token_ids:
            raise APIError(400, "messages render to an empty prompt", param="messages")
        return text, token_ids

    async def _respond(self, started: Started, tracker: ChoiceTracker, meta: ResponseMeta, top: int,
                       plan: ToolPlan) -> Response:
        prompt_logprobs = await collect(started.stream, tracker)
        choices = []
        reasoning_tokens = 0
        for c in tracker.choices:
            reply = parse_reply(tracker.pieces(c.index), started.reasoning, plan.parser)
            reasoning_tokens += reply.reasoning_tokens
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if self.reasoning_parser is not None:
                message["reasoning_content"] = reply.reasoning
            finish_reason = c.finish_reason
            if reply.calls:
                message["tool_calls"] = [call.as_openai() for call in reply.calls]
                finish_reason = _tool_finish_reason(finish_reason)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": {"content": _logprobs(c.logprobs, c.token_ids, top)} if c.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })
        body = {**meta.envelope("chat.completion", choices), "usage": self._usage(tracker, reasoning_tokens),
                **tracker.kv_transfer_field()}
        if meta.id in prompt_logprobs:
            body["prompt_logprobs"] = [None if entry is None else _vllm_logprobs(entry)
                                       for entry in prompt_logprobs[meta.id]]
        return JSONResponse(body)

    async def _events(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta, top: int,
                      include_usage: bool, parsers: list[ReplyParser]) -> AsyncIterator[str]:
        chunk = "chat.completion.chunk"
        # The role first, as OpenAI does: clients see the stream is alive before the first token.
        yield "".join(sse(meta.envelope(chunk, [_chunk_choice(i, {"role": "assistant", "content": ""})]))
                      for i in range(len(parsers)))
        try:
            async for delta in stream:
                events = []
                for choice, sample in tracker.update(delta):
                    message, finish_reason = _reply_delta(parsers[choice.index], sample.text,
                                                          len(sample.token_ids), sample.finish_reason)
                    if not (message or finish_reason or sample.logprobs):
                        continue  # text held back (a partial character, stop string, tool-call tag or marker)
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
            usage = self._usage(tracker, sum(parser.reasoning_tokens for parser in parsers))
            yield sse({**meta.envelope(chunk, []), "usage": usage})
        yield SSE_DONE

    def _usage(self, tracker: ChoiceTracker, reasoning_tokens: int) -> dict[str, Any]:
        """OpenAI's usage; on a server that splits reasoning, the reasoning tokens of all choices too."""
        usage: dict[str, Any] = tracker.usage()
        if self.reasoning_parser is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    """OpenAI's finish reason for a reply that made calls: "tool_calls" when it ended by itself."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _reply_delta(parser: ReplyParser, text: str, num_tokens: int,
                 finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A chunk's delta (reasoning, content and call pieces) from the next text, and its finish reason."""
    parsed = parser.feed(text, num_tokens, last=finish_reason is not None)
    if finish_reason is not None and parser.num_calls:
        finish_reason = _tool_finish_reason(finish_reason)
    message: dict[str, Any] = {"reasoning_content": parsed.reasoning} if parsed.reasoning else {}
    if parsed.content:
        message["content"] = parsed.content
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
