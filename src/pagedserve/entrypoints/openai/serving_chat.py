"""POST /v1/chat/completions: the model's own chat template, streamed or not."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest, RequestStream
from ...outputs import TokenLogprobs
from .protocol import APIError, ChatCompletionRequest, chat_sampling_params, messages_as_dicts, \
    structured_output_param
from .serving import (SSE_DONE, ChoiceTracker, OpenAIServing, ResponseMeta, SSEResponse, engine_failure_event,
                      finite_logprob, sse, until_disconnected)


class ChatServing(OpenAIServing):
    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, ChatCompletionRequest, "chatcmpl")
        params = chat_sampling_params(req, self.limits)
        with self.admission.admit(1) as seat:
            prompt_ids = await self.off_loop(self.render, messages_as_dicts(req.messages))
            await self.compile_constraint(params, structured_output_param(req))
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = self.room_for_output(len(prompt_ids), params.max_tokens, prompt_param="messages",
                                              max_tokens_param=param)
            if max_tokens != params.max_tokens:
                params = dataclasses.replace(params, max_tokens=max_tokens)
            stream = await self.start(seat, [
                GenerationRequest(meta.id, prompt_ids, params, arrival, req.priority, req.cache_salt)
            ])
            tracker = ChoiceTracker([meta.id], params.n, len(prompt_ids), keep_output=not req.stream)
            top = req.top_logprobs or 0
            if req.stream:
                return SSEResponse(self._events(stream, tracker, meta, params.n, top, req.include_usage), seat)
            return await until_disconnected(request, self._respond(stream, tracker, meta, top))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt's token ids; runs in the thread pool (template rendering is CPU work)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not token_ids:
            raise APIError(400, "messages render to an empty prompt", param="messages")
        return token_ids

    async def _respond(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta, top: int) -> Response:
        try:
            async for delta in stream:
                tracker.update(delta)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        choices = [{
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": {"content": _logprobs(c.logprobs, c.token_ids, top)} if c.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        } for c in tracker.choices]
        return JSONResponse({**meta.envelope("chat.completion", choices), "usage": tracker.usage()})

    async def _events(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta, n: int, top: int,
                      include_usage: bool) -> AsyncIterator[str]:
        chunk = "chat.completion.chunk"
        # The role first, as OpenAI does: clients see the stream is alive before the first token.
        yield "".join(sse(meta.envelope(chunk, [_chunk_choice(i, {"role": "assistant", "content": ""})]))
                      for i in range(n))
        try:
            async for delta in stream:
                events = []
                for choice, sample in tracker.update(delta):
                    if not (sample.text or sample.finish_reason or sample.logprobs):
                        continue  # tokens whose text is held back (a partial character or stop string)
                    logprobs = None
                    if sample.logprobs:
                        logprobs = {"content": _logprobs(sample.logprobs, sample.token_ids, top)}
                    events.append(sse(meta.envelope(chunk, [_chunk_choice(
                        choice.index, {"content": sample.text} if sample.text else {}, logprobs,
                        sample.finish_reason, sample.stop_reason,
                    )])))
                if events:
                    yield "".join(events)
        except EngineDeadError as e:
            yield engine_failure_event(e)
        if include_usage:
            yield sse({**meta.envelope(chunk, []), "usage": tracker.usage()})
        yield SSE_DONE


def _chunk_choice(index: int, delta: dict[str, str], logprobs: dict | None = None, finish_reason: str | None = None,
                  stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def _logprobs(entries: Sequence[TokenLogprobs], token_ids: Sequence[int], top: int) -> list[dict[str, Any]]:
    """The chat format: each token with its logprob and the `top` most likely alternatives."""
    out = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        alternatives = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)
        out.append({**_token(chosen.decoded_token, chosen.logprob),
                    "top_logprobs": [_token(lp.decoded_token, lp.logprob) for lp in alternatives]})
    return out
