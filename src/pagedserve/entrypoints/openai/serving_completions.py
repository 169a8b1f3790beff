"""POST /v1/completions: one choice block per prompt, n choices each, streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest, RequestStream, SampleDelta
from ...outputs import TokenLogprobs
from .protocol import APIError, CompletionRequest, Prompt, check_token_ids, completion_prompts, \
    completion_sampling_params, structured_output_param
from .serving import SSE_DONE, ChoiceTracker, OpenAIServing, ResponseMeta, SSEResponse, engine_failure_event, \
    finite_logprob, sse, until_disconnected


@dataclass(frozen=True, slots=True)
class _Prepared:
    token_ids: list[int]
    echo: str  # the prompt text to prepend, "" without echo


class CompletionServing(OpenAIServing):
    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, CompletionRequest, "cmpl")
        params = completion_sampling_params(req, self.limits)
        prompts = completion_prompts(req.prompt)
        if len(prompts) > self.admission.max_queued_requests:
            raise APIError(400, f"prompt has {len(prompts)} prompts; this server takes at most "
                                f"{self.admission.max_queued_requests} per request", param="prompt")
        with self.admission.admit(len(prompts)) as seat:
            prepared = await self.off_loop(self._prepare, prompts, req.echo)
            await self.compile_constraint(params, structured_output_param(req))
            for p in prepared:
                self.room_for_output(len(p.token_ids), params.max_tokens)
            ids = [f"{meta.id}-{i}" for i in range(len(prepared))]
            stream = await self.start(seat, [
                GenerationRequest(rid, p.token_ids, params, arrival, req.priority, req.cache_salt)
                for rid, p in zip(ids, prepared)
            ])
            tracker = ChoiceTracker(ids, params.n, sum(len(p.token_ids) for p in prepared), keep_output=not req.stream)
            if req.stream:
                return SSEResponse(self._events(stream, tracker, meta, prepared, params.n, req.include_usage), seat)
            return await until_disconnected(request, self._respond(stream, tracker, meta, prepared, params.n))

    def _prepare(self, prompts: Sequence[Prompt], echo: bool) -> list[_Prepared]:
        """Tokenise (or check) each prompt; runs in the thread pool."""
        out = []
        vocab = self.engine.vocab_size
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                token_ids = self.tokenizer.encode(prompt) if prompt else []
                echo_text = prompt
            else:
                check_token_ids(prompt, vocab, "prompt")
                token_ids = list(prompt)
                echo_text = self.tokenizer.decode(token_ids) if echo else ""
            if not token_ids:
                raise APIError(400, f"{param} must not be empty", param="prompt")
            out.append(_Prepared(token_ids, echo_text if echo else ""))
        return out

    async def _respond(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta,
                       prepared: list[_Prepared], n: int) -> Response:
        try:
            async for delta in stream:
                tracker.update(delta)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        choices = []
        for choice in tracker.choices:
            echo = prepared[choice.index // n].echo
            text = "".join(choice.text)
            logprobs = None
            if choice.logprobs:
                logprobs = _logprobs(choice.logprobs, choice.token_ids, len(echo))
            choices.append({"index": choice.index, "text": echo + text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        return JSONResponse({**meta.envelope("text_completion", choices), "usage": tracker.usage()})

    async def _events(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta,
                      prepared: list[_Prepared], n: int, include_usage: bool) -> AsyncIterator[str]:
        if prepared[0].echo:
            yield "".join(sse(meta.envelope("text_completion", [_chunk_choice(p * n + s, prepared[p].echo)]))
                          for p in range(len(prepared)) for s in range(n))
        offsets = [len(prepared[c // n].echo) for c in range(len(prepared) * n)]
        try:
            async for delta in stream:
                events = []
                for choice, sample in tracker.update(delta):
                    if not (sample.text or sample.finish_reason or sample.logprobs):
                        continue  # tokens whose text is held back (a partial character or stop string)
                    logprobs = _sample_logprobs(sample, offsets[choice.index])
                    offsets[choice.index] += len(sample.text)
                    events.append(sse(meta.envelope("text_completion", [
                        _chunk_choice(choice.index, sample.text, logprobs, sample.finish_reason, sample.stop_reason)
                    ])))
                if events:
                    yield "".join(events)
        except EngineDeadError as e:
            yield engine_failure_event(e)
        if include_usage:
            yield sse({**meta.envelope("text_completion", []), "usage": tracker.usage()})
        yield SSE_DONE


def _chunk_choice(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None,
                  stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def _sample_logprobs(sample: SampleDelta, offset: int) -> dict | None:
    if not sample.logprobs:
        return None
    return _logprobs(sample.logprobs, sample.token_ids, offset)


def _logprobs(entries: Sequence[TokenLogprobs], token_ids: Sequence[int], offset: int) -> dict[str, list]:
    """The legacy completions format: tokens, their logprobs, top alternatives, char offsets."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(finite_logprob(chosen.logprob))
        top.append({lp.decoded_token: finite_logprob(lp.logprob) for lp in entry.values()})
        offsets.append(offset)
        offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
