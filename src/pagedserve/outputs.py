"""What the engine hands back.

`LLMEngine.step()` returns one frozen `RequestDelta` per request that changed: what the
step added to each of its n samples. Callers that want whole results fold the deltas
with an `OutputAccumulator` into one RequestOutput per request, n CompletionOutputs each.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


# Per generated token: {token_id: Logprob} for the sampled token and the top-k.
TokenLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # The engine's copy, once the request finished (None before, and after an abort).
    metrics: RequestMetrics | None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the
    # first, which has no context), complete from the first output on.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Disaggregated prefill: where the decode instance can pull this request's KV (set on
    # the finished output of a request sent with kv_transfer_params {"do_remote_decode": true}).
    kv_transfer_params: dict | None = None
    # A pooling request's vector (LLMEngine.add_pooling_request), on its finished output.
    embedding: list[float] | None = None


@dataclass(frozen=True, slots=True)
class SampleDelta:
    """What one step added to sample `index` of a request."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    # One dict per token in token_ids when the request asked for logprobs, else None.
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: str | None  # set on the sample's last delta only
    stop_reason: int | str | None


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one step changed in a request: immutable, so it may cross threads as it is."""

    request_id: str
    samples: tuple[SampleDelta, ...]
    finished: bool  # every sample of the request is done; its last delta
    time: float  # time.monotonic() at the end of the step
    arrival_time: float  # the request's, as given to add_request
    num_prompt_tokens: int
    # `time` of the request's previous delta that carried tokens (None: none did yet).
    previous_token_time: float | None = None
    # On the last delta: "abort" if any sample was aborted, else sample 0's reason.
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None  # a copy, on the last delta (None after an abort)
    # On the request's first delta only: its prompt (text when it was given as text)
    # and, with prompt_logprobs, one entry per prompt token (None for the first).
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # A producer's hand-off to the decode instance, on the request's last delta.
    kv_transfer_params: dict | None = None
    # A pooling request's vector, on its last delta.
    embedding: tuple[float, ...] | None = None


class OutputAccumulator:
    """Folds each request's deltas into its RequestOutput (complete once `finished`);
    forgets a request at its last delta."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def add(self, delta: RequestDelta) -> RequestOutput:
        """Apply `delta`; return its request's output so far."""
        out = self._outputs.get(delta.request_id)
        if out is None:
            out = self._outputs[delta.request_id] = RequestOutput(
                delta.request_id, delta.prompt, list(delta.prompt_token_ids or ()), [], False, None,
                list(delta.prompt_logprobs) if delta.prompt_logprobs is not None else None)
        for sample in delta.samples:
            _extend(_completion(out, sample.index), sample)
        if delta.finished:
            del self._outputs[delta.request_id]
            out.finished, out.metrics, out.kv_transfer_params = True, delta.metrics, delta.kv_transfer_params
            out.embedding = list(delta.embedding) if delta.embedding is not None else None
        return out


def _completion(out: RequestOutput, index: int) -> CompletionOutput:
    for c in out.outputs:
        if c.index == index:
            return c
    c = CompletionOutput(index)
    out.outputs.append(c)
    out.outputs.sort(key=lambda o: o.index)
    return c


def _extend(c: CompletionOutput, sample: SampleDelta) -> None:
    c.text += sample.text
    c.token_ids.extend(sample.token_ids)
    if sample.logprobs is not None:
        if c.logprobs is None:
            c.logprobs = []
        c.logprobs.extend(sample.logprobs)
    if sample.finish_reason is not None:
        c.finish_reason, c.stop_reason = sample.finish_reason, sample.stop_reason
