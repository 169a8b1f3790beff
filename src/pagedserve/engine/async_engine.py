"""The engine behind an event loop: one thread owns the LLMEngine, asyncio talks to it.

LLMEngine is not thread-safe, so every add_request / abort / step happens on one
dedicated thread. The event loop sends commands through a thread-safe queue and
gets results back through `loop.call_soon_threadsafe`, one callback per engine
iteration. The thread sleeps on the command queue while there is no work and
steps back to back while there is.

`engine.step()` hands back frozen `RequestDelta`s, which the thread posts as they are.
Each side keeps one table of requests: the engine its own (on the thread), this class
`_entries` (on the loop: whose stream each request's deltas go to).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..multimodal.inputs import ImageInput
from ..outputs import RequestDelta
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from ..spec_decode.acceptance_stats import SpecDecodeStats
from .dashboard_feed import DashboardFeed
from .kv_event_feed import KVEventFeed
from .llm_engine import LLMEngine
from .openmp_pool import release_thread_pool

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A step that has not returned for this long means the loop is stuck. A CPU step
# takes well under a second at the default token budget; a minute leaves room for
# bigger models and slow machines without hiding a hang for long.
STALL_SECONDS = 60.0


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it crashed or was shut down); no request can finish."""


class EngineCrashedError(EngineDeadError):
    """The engine thread raised: the requests it held failed with it (a server error, not
    a shutdown)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the client's request arrived
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    lora_name: str | None = None  # a loaded LoRA adapter; None: the base model
    # Embed the prompt instead of generating (LLMEngine.add_pooling_request; `params` unused).
    pooling: PoolingParams | None = None
    # A vision model's images, one per placeholder of the prompt, in order (docs/vision.md).
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state after one iteration of the thread, for admission, health and metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_adds_processed: int = 0
    busy: bool = False
    # Speculative decoding counters (a copy); None when off.
    spec_decode: SpecDecodeStats | None = None
    # Which kernel path runs ("native" or "torch"; "" before the first snapshot).
    kernels: str = ""
    # The KV connector's counters (kv_transfer_*, or the disk tier's kv_disk_*); None without one.
    kv_transfer: dict[str, int] | None = None
    time: float = field(default_factory=time.monotonic)


# The snapshot's fields that are SchedulerStats fields of the same name.
_SCHEDULER_FIELDS = ("num_running", "num_waiting", "kv_usage", "num_preemptions", "prefix_cache_queries",
                     "prefix_cache_hits")


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    finish_reason: str  # "abort" if any sample was aborted, else sample 0's reason
    e2e_latency: float
    queue_time: float | None  # None when it never got scheduled or was aborted
    num_prompt_tokens: int


@dataclass(slots=True)
class StepStats:
    """What one delivery from the engine thread means for the server's metrics, read
    from its frozen deltas alone."""

    num_generation_tokens: int = 0
    first_tokens: list[tuple[float, int]] = field(default_factory=list)  # (TTFT, prompt tokens)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)

    def add(self, delta: RequestDelta) -> None:
        num_tokens = sum(len(sample.token_ids) for sample in delta.samples)
        if num_tokens:
            self.num_generation_tokens += num_tokens
            if delta.previous_token_time is None:
                self.first_tokens.append((delta.time - delta.arrival_time, delta.num_prompt_tokens))
            else:
                self.inter_token_latencies.append(delta.time - delta.previous_token_time)
        if delta.finished:
            m = delta.metrics
            self.finished.append(FinishedRequest(
                finish_reason=delta.finish_reason,
                e2e_latency=delta.time - delta.arrival_time,
                queue_time=None if m is None or m.first_scheduled_time is None
                else m.first_scheduled_time - delta.arrival_time,
                num_prompt_tokens=delta.num_prompt_tokens,
            ))


# -- commands: event loop -> engine thread ---------------------------------------------


@dataclass(frozen=True, slots=True)
class _Add:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Crash:
    """End the engine thread with `error` (a tensor-parallel rank died while it idled)."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread, between steps."""

    fn: Callable[[LLMEngine], None]


_STOP = object()
# Build a dashboard frame after this iteration.
_FRAME = object()


# -- loop-side bookkeeping ----------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    stream: RequestStream | None  # None once the consumer has gone (aborted by it)
    ack: asyncio.Future


class RequestStream:
    """The deltas of a group of requests added together (one HTTP request, possibly
    several prompts), in engine order. Iteration ends when all of them finished."""

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str], acks: Sequence[asyncio.Future]):
        self._engine = engine
        self.request_ids = tuple(request_ids)
        self._num_unfinished = len(self.request_ids)
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._acks = list(acks)
        self.started = False  # a delta has arrived: the group left the waiting queue at least once

    async def accepted(self) -> None:
        """Return once the engine has taken every request of the group. If it rejected
        any (ValueError, naming the problem), the others are aborted and the error raised;
        cancelling the wait aborts them too."""
        try:
            errors = await asyncio.gather(*self._acks)
        except BaseException:
            self.abort()
            raise
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            self.abort()
            raise error

    @property
    def finished(self) -> bool:
        return not self._num_unfinished

    def put(self, item: RequestDelta | BaseException) -> None:
        """The engine's side: a delta of one of the group's requests, or the error that ends the stream."""
        if not isinstance(item, BaseException):
            self.started = True
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while self._num_unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._num_unfinished = 0
                raise item
            if item.finished:
                self._num_unfinished -= 1
            yield item

    def fail(self, error: BaseException) -> None:
        """Abort the group's unfinished requests and end its iteration with `error` (its
        consumer raises it): how admission displaces waiting work."""
        if self._num_unfinished:
            self._engine.abort(self.request_ids)
            self.put(error)

    def abort(self) -> None:
        """Stop every unfinished request of the group and free its KV blocks; idempotent."""
        if self._num_unfinished:
            self._engine.abort(self.request_ids)
        self._num_unfinished = 0


class AsyncEngine:
    """Owns the engine thread; every public method must be called on the event loop."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._step_listeners: list[Callable[[StepStats], None]] = []
        self._feed: DashboardFeed | None = None
        self._on_frame: Callable[[dict], None] | None = None
        self._kv_feed: KVEventFeed | None = None
        # Constants read before the thread starts; afterwards only the thread touches the engine.
        self.vocab_size: int = engine.loaded.config.vocab_size
        stats = engine.engine_stats().scheduler
        self.kv_capacity_tokens: int = stats.kv_total_blocks * engine.config.kv.block_size
        # What one sequence can actually reach: the context limit, or the whole KV pool
        # if that is smaller (the engine rejects a request that could never fit).
        self.max_context_len: int = min(engine.max_model_len, self.kv_capacity_tokens)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._thread_main, name="pagedserve-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._entries: dict[str, _Entry] = {}
        # run_on_thread's futures: failed with the thread if it stops before running them.
        self._calls: set[asyncio.Future] = set()
        self._num_adds_sent = 0
        self._error: BaseException | None = None
        self._closing = False
        self._refusing = False
        self.snapshot = EngineSnapshot(kv_usage=stats.kv_usage, kernels=engine.kernels,
                                       kv_transfer=engine.engine_stats().kv_transfer)
        # Called on the event loop once the thread has crashed and its requests have failed;
        # the server uses it to exit non-zero rather than stay up unable to serve.
        self.on_crash: Callable[[BaseException], None] | None = None
        if engine.tp is not None:
            # A tensor-parallel rank that dies while the engine idles ends the thread the
            # way a failed step does (the watcher calls this from its own thread).
            engine.tp.on_failure = lambda error: self._commands.put(_Crash(error))

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener` on the event loop after each delivery that carried deltas, with
        what those frozen deltas add up to (the server's metrics, the dashboard)."""
        self._step_listeners.append(listener)

    def attach_feed(self, feed: DashboardFeed, on_frame: Callable[[dict], None]) -> None:
        """Before start(): let `feed` watch the engine thread; frames asked for with
        request_frame() reach `on_frame` on the event loop."""
        self._feed = feed
        self._on_frame = on_frame

    def attach_kv_events(self, feed: KVEventFeed) -> None:
        """Before start(): let `feed` drain the block pool's index changes after each iteration."""
        self._kv_feed = feed

    def call_on_thread(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run `fn(engine)` on the engine thread before its next step (settings that
        must not change mid-step)."""
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        self._commands.put(_Call(fn))

    async def run_on_thread(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` on the engine thread between steps, in order with the requests sent
        before it; its result, or the exception it raised (the thread carries on)."""
        if self._error is not None or self._loop is None or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        future = self._loop.create_future()
        self._calls.add(future)

        def call(engine: LLMEngine) -> None:
            try:
                result, error = fn(engine), None
            except Exception as e:
                result, error = None, e
            self._loop.call_soon_threadsafe(_settle, future, result, error)

        self.call_on_thread(call)
        try:
            return await future
        finally:
            self._calls.discard(future)

    def request_frame(self) -> None:
        """Ask the engine thread for a dashboard frame after its current iteration
        (it wakes up for it when idle). No frame comes if nothing changed."""
        if self._feed is not None and not self._closing:
            self._commands.put(_FRAME)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # The model was loaded (and warmed up) on this thread; from here on only the engine
        # thread computes, and a second OpenMP pool would slow each of its parallel regions.
        release_thread_pool()
        self._thread.start()

    async def close(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the thread and wait for it (at most one step)."""
        if self._closing:
            return
        self._closing = True
        if self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join, timeout)
        if not self._thread.is_alive():  # never under a thread still stepping
            self.engine.shutdown()  # tensor-parallel ranks, the KV connector's threads
        self._fail_all(EngineDeadError("the server is shutting down"))

    # -- state ----------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """The thread is alive, did not crash and, when it has work, is stepping."""
        if self._error is not None or self._closing or not self._thread.is_alive():
            return False
        snap = self.snapshot
        return not snap.busy or time.monotonic() - snap.time < STALL_SECONDS

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine plus those sent but not yet taken in by the thread."""
        snap = self.snapshot
        return snap.num_waiting + self._num_adds_sent - snap.num_adds_processed

    @property
    def num_unfinished(self) -> int:
        return len(self._entries)

    # -- requests -------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestStream:
        """Queue `requests` to stream into one RequestStream; `await stream.accepted()`
        learns whether the engine took them. Raises EngineDeadError if the thread is gone."""
        if self._closing or self._refusing:
            raise EngineDeadError("the server is shutting down")
        if self._error is not None or self._loop is None:
            raise EngineDeadError("the engine is not running")
        for r in requests:
            if r.request_id in self._entries:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        acks = [self._loop.create_future() for _ in requests]
        stream = RequestStream(self, [r.request_id for r in requests], acks)
        for r, ack in zip(requests, acks):
            self._entries[r.request_id] = _Entry(stream, ack)
            self._num_adds_sent += 1
            self._commands.put(_Add(r))
        return stream

    def abort_all(self) -> None:
        """Shutdown: abort every request and take no new ones. Consumers still listening
        get a last delta with finish_reason "abort"."""
        self._refusing = True
        for request_id in list(self._entries):
            self._abort(request_id, notify=True)

    def abort(self, request_ids: Iterable[str]) -> None:
        """The consumer of these requests has gone: abort those unfinished (freeing their
        KV blocks) and deliver nothing more of them."""
        for request_id in request_ids:
            self._abort(request_id, notify=False)

    def _abort(self, request_id: str, *, notify: bool) -> None:
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if not notify:
            entry.stream = None
        self._commands.put(_Abort(request_id))

    # -- loop side of the bridge -------------------------------------------------------------

    def _deliver(self, acks: list[tuple[str, Exception | None]], deltas: list[RequestDelta]) -> None:
        for request_id, error in acks:
            entry = self._entries.get(request_id)
            if entry is None:
                continue
            if error is not None:
                del self._entries[request_id]
            if not entry.ack.done():
                entry.ack.set_result(error)
        stats = StepStats()
        for delta in deltas:
            entry = self._entries.get(delta.request_id)
            if entry is None:
                continue
            stats.add(delta)
            if entry.stream is not None:
                entry.stream.put(delta)
            if delta.finished:
                del self._entries[delta.request_id]
        if deltas:
            for listener in self._step_listeners:
                listener(stats)

    def _fail_all(self, error: BaseException) -> None:
        for future in self._calls:
            if not future.done():
                future.set_exception(error)
        for entry in self._entries.values():
            if not entry.ack.done():
                entry.ack.set_exception(error)
            elif entry.stream is not None:
                entry.stream.put(error)
        self._entries.clear()

    def _on_thread_crash(self, error: BaseException) -> None:
        self._error = error
        self._fail_all(EngineCrashedError("the engine stopped after an internal error"))
        if self.on_crash is not None:
            self.on_crash(error)

    # -- the engine thread ------------------------------------------------------------------

    def _thread_main(self) -> None:
        engine = self.engine
        feed = self._feed
        kv_feed = self._kv_feed
        num_adds = 0
        try:
            while True:
                # Block only when there is nothing to step.
                commands = [] if engine.has_unfinished_requests() else [self._commands.get()]
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                acks: list[tuple[str, Exception | None]] = []
                deltas: list[RequestDelta] = []
                frame_due = False
                for command in commands:
                    if command is _STOP:
                        for request_id in engine.unfinished_request_ids():
                            engine.abort(request_id)
                        return
                    if command is _FRAME:
                        frame_due = True
                    elif isinstance(command, _Crash):
                        raise command.error
                    elif isinstance(command, _Call):
                        # A command from the HTTP side (KV events, the dashboard's switches)
                        # that raises is a bug in that command: it must not stop the engine.
                        try:
                            command.fn(engine)
                        except Exception:
                            logger.exception("a command on the engine thread failed; the engine carries on")
                    elif isinstance(command, _Add):
                        num_adds += 1
                        acks.append(self._thread_add(command.request))
                    else:
                        aborted = engine.abort(command.request_id)
                        if aborted is not None:
                            deltas.append(aborted)
                if engine.has_unfinished_requests():
                    # Unwatched, the dashboard costs this one flag read per step.
                    if feed is not None and feed.watched:
                        started = time.perf_counter()
                        deltas += engine.step()
                        feed.record_step(engine, time.perf_counter() - started)
                    else:
                        deltas += engine.step()
                self.snapshot = _snapshot(engine, num_adds)
                if kv_feed is not None and kv_feed.active:
                    kv_feed.after_step(engine)
                if acks or deltas:
                    self._loop.call_soon_threadsafe(self._deliver, acks, deltas)
                if frame_due:
                    frame = feed.build_frame(engine)
                    if frame is not None:
                        self._loop.call_soon_threadsafe(self._on_frame, frame)
        except BaseException as error:  # a bug: the server must report it, not hang
            logger.exception("engine thread crashed")
            self._loop.call_soon_threadsafe(self._on_thread_crash, error)

    def _thread_add(self, r: GenerationRequest) -> tuple[str, Exception | None]:
        try:
            if r.pooling is not None:
                self.engine.add_pooling_request(r.prompt_token_ids, r.pooling, request_id=r.request_id,
                                                priority=r.priority, cache_salt=r.cache_salt,
                                                arrival_time=r.arrival_time, lora_name=r.lora_name)
            else:
                self.engine.add_request(
                    r.prompt_token_ids, r.params, request_id=r.request_id, priority=r.priority,
                    cache_salt=r.cache_salt, arrival_time=r.arrival_time, kv_transfer_params=r.kv_transfer_params, lora_name=r.lora_name,
                    images=r.images,
                )
        except ValueError as error:
            return r.request_id, error
        except Exception as error:  # an engine bug must cost this request, not the thread
            logger.exception("add_request failed for %s", r.request_id)
            return r.request_id, error
        return r.request_id, None


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # failed already: the thread stopped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _snapshot(engine: LLMEngine, num_adds: int) -> EngineSnapshot:
    stats = engine.engine_stats()
    return EngineSnapshot(
        **{name: getattr(stats.scheduler, name) for name in _SCHEDULER_FIELDS},
        num_adds_processed=num_adds,
        busy=engine.has_unfinished_requests(),
        spec_decode=stats.spec_decode,
        kernels=stats.kernels,
        kv_transfer=stats.kv_transfer,
    )
