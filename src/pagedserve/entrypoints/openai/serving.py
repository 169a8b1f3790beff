"""What both generation endpoints share: admission, off-loop tokenisation, context
checks, handing requests to the engine, SSE framing and client-disconnect handling.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...engine.async_engine import AsyncEngine, EngineCrashedError, EngineDeadError, GenerationRequest, RequestStream
from ...http.chat_images import ImageLoader, ImagePolicy, image_parts
from ...http.disconnect import sse
from ...http.errors import APIError
from ...http.json_body import M, parse_body
from ...http.openai_bodies import ChatMessage
from ...http.tenants import TenantState, current_tenant
from ...multimodal.inputs import ImageInput
from ...outputs import RequestDelta, SampleDelta, TokenLogprobs
from ...sampling_params import SamplingParams
from .protocol import RequestLimits, bad_request
from .served_models import ServedModels

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
# OpenAI-style clients parse logprobs as JSON numbers; -inf is not one.
_MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


# -- admission ------------------------------------------------------------------------------


# Batch lines (batch_runner.py) run at this priority, after every interactive request
# (whose priorities are capped just above it), so under --scheduling-policy priority they
# are scheduled last and preempted first.
BACKGROUND_PRIORITY = 2 ** 62
_IN_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("pagedserve_background", default=False)
# The priority the request being served asked for (read_request sets it), so admission can
# rank an arrival against the waiting work before the handler builds its engine requests.
_ASKED_PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar("pagedserve_asked_priority", default=0)


@contextlib.contextmanager
def background_work() -> Iterator[None]:
    """Requests served inside this run as batch work: at BACKGROUND_PRIORITY, outside the
    interactive queue limit (the batch runner bounds how many it has in flight)."""
    token = _IN_BACKGROUND.set(True)
    try:
        yield
    finally:
        _IN_BACKGROUND.reset(token)


def request_priority(asked: int) -> int:
    """The priority a request runs at: batch work's, or what it asked for (raised to its
    tenant's class) and never behind batch work."""
    if _IN_BACKGROUND.get():
        return BACKGROUND_PRIORITY
    tenant = current_tenant()
    priority = asked if tenant is None else tenant.tenant.request_priority(asked)
    return min(priority, BACKGROUND_PRIORITY - 1)


class Admission:
    """Who may start generating: not while draining (503), not past the queue limit (429).

    Counts requests being tokenised as waiting too, so a burst cannot slip past the
    limit while its prompts are still in the thread pool. Batch work is not counted. Under
    --scheduling-policy priority a full queue does not refuse an arrival that outranks
    waiting work: the lowest-priority request still waiting (no output yet, not streaming)
    is displaced instead, answered 429 itself.
    """

    def __init__(self, engine: AsyncEngine, max_queued_requests: int):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.draining = False
        self.displace = engine.engine.config.scheduling.scheduling_policy == "priority"
        self._preparing = 0
        self._active = 0
        # Seats whose requests reached the engine: interactive ones, and batch work's.
        self._seats: set[Seat] = set()
        self._background: set[Seat] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        return self._active

    @property
    def num_waiting(self) -> int:
        """Interactive requests waiting: in the engine's queue or being prepared."""
        background = sum(seat.num_requests for seat in self._background if seat.displaceable)
        return max(0, self.engine.num_waiting - background) + self._preparing

    def admit(self, num_requests: int) -> Seat:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not self.engine.is_healthy:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        priority = request_priority(_ASKED_PRIORITY.get())
        if _IN_BACKGROUND.get():
            return Seat(self, num_requests, priority, background=True)
        waiting = self.num_waiting
        if waiting >= self.max_queued_requests and not self._displace_below(priority):
            raise APIError(
                429, f"{waiting} requests are already waiting (limit {self.max_queued_requests}); retry later",
                code="rate_limit_exceeded", headers={"Retry-After": "1"},
            )
        self._preparing += num_requests
        self._active += 1
        self._idle.clear()
        return Seat(self, num_requests, priority, background=False)

    def _displace_below(self, priority: int) -> bool:
        """Displace the lowest-priority waiting request group that `priority` outranks (the
        latest admitted among equals); False when there is none."""
        if not self.displace:
            return False
        victims = [seat for seat in self._seats if seat.displaceable and seat.priority > priority]
        if not victims:
            return False
        victim = max(victims, key=lambda seat: (seat.priority, seat.admitted))
        self._seats.discard(victim)  # not a victim twice while its handler winds up
        victim.displaced(APIError(429, "displaced from the queue by a higher-priority request; retry later",
                                  code="rate_limit_exceeded", headers={"Retry-After": "1"}))
        return True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def release(self, seat: Seat, num_preparing: int) -> None:
        """A seat closed; `num_preparing` of its requests never reached the engine."""
        self._seats.discard(seat)
        self._background.discard(seat)
        if seat.background:
            return
        self._preparing -= num_preparing
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    def submitted(self, seat: Seat) -> None:
        """A seat's requests reached the engine: they wait there now, no longer here."""
        if seat.background:
            self._background.add(seat)
            return
        self._preparing -= seat.num_requests
        self._seats.add(seat)


class Seat:
    """One admitted HTTP request: its place in the queue count and, once started, its
    engine requests. Closing it (exactly once, however the request ends) aborts what
    is unfinished. Used as a context manager that closes unless handed to a response."""

    def __init__(self, admission: Admission, num_requests: int, priority: int, *, background: bool):
        self._admission = admission
        self.num_requests = num_requests
        self.priority = priority
        self.background = background
        self.admitted = time.monotonic()
        self._preparing = True
        self._closed = False
        self._handed_over = False
        self.stream: RequestStream | None = None

    @property
    def displaceable(self) -> bool:
        """Still waiting (nothing generated yet) and answered whole, so a 429 can replace it."""
        return self.stream is not None and not self.stream.started and not self._handed_over

    def attach(self, stream: RequestStream) -> None:
        self.stream = stream
        self._preparing = False
        self._admission.submitted(self)

    def displaced(self, error: APIError) -> None:
        if self.stream is not None:
            self.stream.fail(error)

    def hand_over(self) -> None:
        self._handed_over = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.stream is not None:
            self.stream.abort()
        self._admission.release(self, self.num_requests if self._preparing else 0)

    def __enter__(self) -> Seat:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handed_over:
            self.close()


# -- per-choice accumulation ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """id / created / model, shared by every chunk of one response."""

    id: str
    created: int
    model: str

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


@dataclass(slots=True)
class ChoiceState:
    """One choice's text and tokens so far (prompt p, sample s -> choice p * n + s)."""

    index: int
    text: list[str] = field(default_factory=list)
    piece_tokens: list[int] = field(default_factory=list)  # each text piece's token count
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChoiceTracker:
    """Maps a group's deltas to OpenAI choice indices and keeps usage counts."""

    def __init__(self, request_ids: Sequence[str], n: int, num_prompt_tokens: int, keep_output: bool):
        self._prompt_of = {rid: i for i, rid in enumerate(request_ids)}
        self._n = n
        self._keep = keep_output
        self.choices = [ChoiceState(i) for i in range(len(request_ids) * n)]
        self.num_prompt_tokens = num_prompt_tokens
        self.kv_transfer_params: dict | None = None
        # The tenant (--api-keys) whose budget the generated tokens are charged to, as they arrive.
        self._tenant = current_tenant()

    def update(self, delta: RequestDelta) -> list[tuple[ChoiceState, SampleDelta]]:
        """Apply a delta; return (choice, sample delta) for each sample it touched."""
        base = self._prompt_of[delta.request_id] * self._n
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        touched = []
        for sample in delta.samples:
            choice = self.choices[base + sample.index]
            choice.num_tokens += len(sample.token_ids)
            if self._keep:
                choice.text.append(sample.text)
                choice.piece_tokens.append(len(sample.token_ids))
                choice.token_ids.extend(sample.token_ids)
                if sample.logprobs:
                    choice.logprobs.extend(sample.logprobs)
            if sample.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = sample.finish_reason, sample.stop_reason
            touched.append((choice, sample))
        if self._tenant is not None:
            self._tenant.charge_generated(sum(len(sample.token_ids) for sample in delta.samples))
        return touched

    def pieces(self, index: int) -> list[tuple[str, int]]:
        """Choice `index`'s output as its deltas' (text, token count)."""
        choice = self.choices[index]
        return list(zip(choice.text, choice.piece_tokens))

    def kv_transfer_field(self) -> dict[str, dict]:
        """The response's top-level kv_transfer_params (a prefill instance's hand-off), if any."""
        return {"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params is not None else {}

    def usage(self) -> dict[str, int]:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}


# -- the shared handler plumbing ----------------------------------------------------------------


class SSEResponse(StreamingResponse):
    """A text/event-stream response (or another streamed `media_type`: Ollama's NDJSON)
    that closes its Seat however it ends: done, client gone (Starlette cancels the body)
    or never started."""

    def __init__(self, events: AsyncIterator[str], seat: Seat, media_type: str = "text/event-stream"):
        super().__init__(events, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._seat = seat
        seat.hand_over()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._seat.close()


@dataclass(frozen=True, slots=True)
class ServingContext:
    """What every endpoint serves with; one per app."""

    engine: AsyncEngine
    admission: Admission
    limits: RequestLimits
    models: ServedModels
    executor: Executor  # the tokenizer threads
    media: ImagePolicy = ImagePolicy()  # --limit-mm-per-prompt, --allowed-media-domains


class OpenAIServing:
    def __init__(self, context: ServingContext):
        self.engine = context.engine
        self.admission = context.admission
        self.limits = context.limits
        self.models = context.models
        self.tokenizer = context.engine.engine.tokenizer
        self._executor = context.executor
        self.images = ImageLoader(context.media, context.engine.engine.vision, self.encode_marker)

    async def read_request(self, request: Request, model: type[M], id_prefix: str) -> tuple[float, M, ResponseMeta]:
        """The arrival time, the parsed body and the response's id/created/model."""
        arrival = time.monotonic()
        body = parse_body(await request.body(), model)
        _ASKED_PRIORITY.set(getattr(body, "priority", 0))
        meta = ResponseMeta(f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.resolve_model(body.model))
        return arrival, body, meta

    def resolve_model(self, name: str | None) -> str:
        """The name responses carry (a LoRA adapter's own); 404 for a model this server does not serve."""
        return self.models.resolve(name)

    def encode_marker(self, text: str) -> list[int]:
        """A reasoning marker's token ids, as the model writes it (ReasoningMarkers)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` runs; None for the base model."""
        return self.models.lora_of(model)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenising, template rendering) in the pool, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def load_images(self, messages: Sequence[ChatMessage], model: str | None) -> list[ImageInput]:
        """The messages' images decoded (fetching and decoding in the pool), after the cheap
        checks: the model `model` (as the request named it) takes images, and not this many."""
        parts = image_parts(messages)
        if not parts:
            return []
        self.images.check(parts, self.resolve_model(model))
        return await self.off_loop(self.images.load, parts)

    async def compile_constraint(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's structured-output constraint in the pool (the engine
        caches it, so adding the request is then instant); 400 if it is invalid or
        too slow to compile."""
        if params.structured_outputs is None:
            return
        try:
            await self.off_loop(self.engine.engine.structured_outputs.compile, params.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def room_for_output(self, num_prompt_tokens: int, max_tokens: int | None, *, prompt_param: str = "prompt",
                        max_tokens_param: str = "max_tokens") -> int:
        """max_tokens checked against the context (or, when None, all the room left)."""
        limit = self.engine.max_context_len
        if num_prompt_tokens >= limit:
            raise APIError(
                400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                     f"{num_prompt_tokens} tokens, which leaves no room to generate",
                param=prompt_param, code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400, f"this model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} "
                     f"tokens and {max_tokens_param} is {max_tokens} ({num_prompt_tokens + max_tokens} in all)",
                param=max_tokens_param, code="context_length_exceeded",
            )
        return max_tokens

    async def start(self, seat: Seat, requests: Sequence[GenerationRequest]) -> RequestStream:
        """Hand `requests` to the engine under `seat`; 400 if the engine rejects one."""
        tenant = current_tenant()
        if tenant is not None:
            requests = for_tenant(tenant, requests)
        requests = [dataclasses.replace(r, priority=request_priority(r.priority)) for r in requests]
        try:
            stream = self.engine.submit(requests)
            # From here the engine's queue counts them, and closing the seat aborts them.
            seat.attach(stream)
            await stream.accepted()
        except ValueError as e:
            raise bad_request(e) from None
        except EngineDeadError as e:
            raise engine_error(e) from None
        if tenant is not None:
            tenant.charge_prompt(sum(len(r.prompt_token_ids) for r in requests))
        return stream


def for_tenant(tenant: TenantState, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
    """The requests with their tenant's priority class and prefix-cache salt (tenant_keys.Tenant)."""
    t = tenant.tenant
    return [dataclasses.replace(r, cache_salt=t.cache_salt(r.cache_salt)) for r in requests]


def engine_error(error: EngineDeadError) -> APIError:
    """500 for requests a crashed engine took down with it, 503 when it is shutting down."""
    if isinstance(error, EngineCrashedError):
        return APIError(500, str(error), code="engine_crashed")
    return APIError(503, str(error), code="engine_unavailable")


async def collect(stream: RequestStream, tracker: ChoiceTracker) -> dict[str, tuple[TokenLogprobs | None, ...]]:
    """Run a non-streamed response's requests to their end into `tracker` (its engine
    error if the engine dies); the prompt logprobs of the requests that asked, by request id."""
    prompt_logprobs = {}
    try:
        async for delta in stream:
            tracker.update(delta)
            if delta.prompt_logprobs is not None:
                prompt_logprobs[delta.request_id] = delta.prompt_logprobs
    except EngineDeadError as e:
        raise engine_error(e) from None
    return prompt_logprobs


def engine_failure_event(error: EngineDeadError) -> str:
    return sse(engine_error(error).body())
