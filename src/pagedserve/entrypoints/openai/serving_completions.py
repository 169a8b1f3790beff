"""POST /v1/completions: one choice block per prompt, n choices each, streamed or not.

The text comes back whole, reasoning and all (as vLLM's completions do); a
thinking_token_budget is applied to each prompt as its text leaves the reasoning
section (open or not)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest, RequestStream
from ...http.disconnect import sse, until_disconnected
from ...http.errors import APIError
from ...http.openai_bodies import CompletionRequest, Prompt, check_token_ids, completion_prompts
from ...http.reasoning_plan import plan_reasoning
from ...http.reasoning_parsers import ReasoningFormat
from ...outputs import SampleDelta, TokenLogprobs
from .protocol import check_prompt_chars, completion_sampling_params, structured_output_param
from .serving import SSE_DONE, ChoiceTracker, OpenAIServing, ResponseMeta, ServingContext, SSEResponse, collect, \
    engine_failure_event, finite_logprob


@dataclass(frozen=True, slots=True)
class _Prepared:
    token_ids: list[int]
    echo: str  # the prompt text to prepend, "" without echo
    text: str | None  # the prompt's text (None: given as token ids)


class CompletionServing(OpenAIServing):
    def __init__(self, context: ServingContext, reasoning_parser: ReasoningFormat | None = None):
        super().__init__(context)
        self.reasoning_parser = reasoning_parser

    async def create(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, CompletionRequest, "cmpl")
        params = completion_sampling_params(req, self.limits)
        if req.thinking_token_budget is not None and req.use_beam_search:
            raise APIError(400, "thinking_token_budget is not supported with use_beam_search",
                           param="thinking_token_budget")
        reasoning = plan_reasoning(self.reasoning_parser, budget=req.thinking_token_budget)
        prompts = completion_prompts(req.prompt)
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise APIError(400, "kv_transfer_params goes with one prompt", param="kv_transfer_params")
        if len(prompts) > self.admission.max_queued_requests:
            raise APIError(400, f"prompt has {len(prompts)} prompts; this server takes at most "
                                f"{self.admission.max_queued_requests} per request", param="prompt")
        with self.admission.admit(len(prompts)) as seat:
            prepared = await self.off_loop(self._prepare, prompts, req.echo)
            await self.compile_constraint(params, structured_output_param(req))
            for p in prepared:
                self.room_for_output(len(p.token_ids), params.max_tokens)
            ids = [f"{meta.id}-{i}" for i in range(len(prepared))]
            texts = [p.text for p in prepared]
            if reasoning.budget is not None:
                texts = [t if t is not None else await self.off_loop(self.tokenizer.decode, p.token_ids)
                         for t, p in zip(texts, prepared)]
            stream = await self.start(seat, [
                GenerationRequest(rid, p.token_ids,
                                  reasoning.apply(params, reasoning.for_prompt(text or ""), self.encode_marker),
                                  arrival, req.priority, req.cache_salt, req.kv_transfer_params,
                                  self.lora_of(meta.model))
                for rid, p, text in zip(ids, prepared, texts)
            ])
            tracker = ChoiceTracker(ids, params.n, sum(len(p.token_ids) for p in prepared), keep_output=not req.stream)
            # max_tokens 0 (prompt scoring): the one token the engine samples is not shown.
            prompt_only = req.max_tokens == 0
            if req.stream:
                scored = params.prompt_logprobs is not None
                return SSEResponse(self._events(stream, tracker, meta, prepared, params.n, req.include_usage,
                                                prompt_only, scored), seat)
            return await until_disconnected(request, self._respond(stream, tracker, meta, prepared, params.n,
                                                                   prompt_only))

    def _prepare(self, prompts: Sequence[Prompt], echo: bool) -> list[_Prepared]:
        """Tokenise (or check) each prompt; runs in the thread pool."""
        out = []
        vocab = self.engine.vocab_size
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                check_prompt_chars(prompt, self.limits, self.engine.max_context_len, param)
                token_ids = self.tokenizer.encode(prompt) if prompt else []
                echo_text = prompt
            else:
                check_token_ids(prompt, vocab, "prompt")
                token_ids = list(prompt)
                echo_text = self.tokenizer.decode(token_ids) if echo else ""
            if not token_ids:
                raise APIError(400, f"{param} must not be empty", param="prompt")
            out.append(_Prepared(token_ids, echo_text if echo else "", prompt if isinstance(prompt, str) else None))
        return out

    async def _respond(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta,
                       prepared: list[_Prepared], n: int, prompt_only: bool) -> Response:
        prompt_logprobs = await collect(stream, tracker)
        ids = [f"{meta.id}-{i}" for i in range(len(prepared))]
        choices = []
        for choice in tracker.choices:
            p = choice.index // n
            echo = prepared[p].echo
            if prompt_only:
                choice.text, choice.token_ids, choice.logprobs, choice.num_tokens = [], [], [], 0
            text = "".join(choice.text)
            logprobs = None
            if ids[p] in prompt_logprobs:
                logprobs = self._prompt_logprobs(prompt_logprobs[ids[p]], prepared[p].token_ids)
                logprobs = _join(logprobs, _logprobs(choice.logprobs, choice.token_ids, len(echo)))
            elif choice.logprobs:
                logprobs = _logprobs(choice.logprobs, choice.token_ids, len(echo))
            choices.append({"index": choice.index, "text": echo + text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        return JSONResponse({**meta.envelope("text_completion", choices), "usage": tracker.usage(),
                             **tracker.kv_transfer_field()})

    def _prompt_logprobs(self, entries: Sequence[TokenLogprobs | None], token_ids: Sequence[int]) -> dict[str, list]:
        """The prompt's part of an echoed choice: the first token has no logprob (None), as in OpenAI's API."""
        first = self.tokenizer.decode([token_ids[0]])
        rest = _logprobs(entries[1:], token_ids[1:], len(first))
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}

    async def _events(self, stream: RequestStream, tracker: ChoiceTracker, meta: ResponseMeta,
                      prepared: list[_Prepared], n: int, include_usage: bool, prompt_only: bool,
                      scored: bool) -> AsyncIterator[str]:
        """`scored`: the echo carries the prompt's logprobs, so it waits for them."""
        ids = {f"{meta.id}-{i}": i for i in range(len(prepared))}

        def echo_chunks(p: int, entries: Sequence[TokenLogprobs | None] | None) -> str:
            logprobs = self._prompt_logprobs(entries, prepared[p].token_ids) if entries is not None else None
            return "".join(sse(meta.envelope("text_completion", [_chunk_choice(p * n + s, prepared[p].echo, logprobs)]))
                           for s in range(n))

        if prepared[0].echo and not scored:
            yield "".join(echo_chunks(p, None) for p in range(len(prepared)))
        offsets = [len(prepared[c // n].echo) for c in range(len(prepared) * n)]
        try:
            async for delta in stream:
                events = []
                if delta.prompt_logprobs is not None:  # they come with the request's first token
                    events.append(echo_chunks(ids[delta.request_id], delta.prompt_logprobs))
                for choice, sample in tracker.update(delta):
                    if prompt_only:
                        choice.num_tokens = 0
                        if sample.finish_reason is not None:
                            events.append(sse(meta.envelope("text_completion", [_chunk_choice(
                                choice.index, "", None, sample.finish_reason, sample.stop_reason)])))
                        continue
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


def _join(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + second[key] for key in first}


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
