"""The step loop: schedule -> run the model -> sample -> update -> detokenize.

The engine owns what the core does not: tokenisation, sampling state (seeded
generators, parallel-sampling forks), incremental detokenisation with stop
strings, per-request metrics and the frozen RequestDeltas handed to callers
(each step's news, never changed after; callers accumulate them).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from ..core.kv_plan import KVCachePlan
from ..core.scheduler_output import SchedulerOutput, SchedulerStats
from ..core.request import ImageSpan, Request, RequestStatus
from ..core.scheduler import Scheduler
from ..distributed.executor import TensorParallelExecutor
from ..engine_config import EngineConfig
from ..kernels import kernel_report
from ..kv_transfer.base import KVConnectorWorker
from ..model.loader import LoadedModel, load_model
from ..multimodal.idefics3_prompts import Idefics3Prompts
from ..multimodal.inputs import ImageInput
from ..outputs import Logprob, RequestDelta, RequestMetrics, SampleDelta, TokenLogprobs
from ..pooling_params import PoolingParams
from ..resolved_config import ResolvedConfig
from ..sampling_params import SamplingParams
from ..sampling_state import SamplingState
from ..spec_decode.acceptance_stats import SpecDecodeStats
from ..structured_output.grammar_backend import Matcher
from ..structured_output.manager import StructuredOutputManager
from ..worker.image_embeds import ImageEmbedder
from ..worker.model_runner import ModelRunner, RunnerOutput
from ..worker.pooling import finish_embedding
from ..worker.sampler import LogprobsTensors
from .beam_outputs import beam_group, beam_samples, beam_sampling_state
from .builder import build_parts
from .detokenizer import IncrementalDetokenizer
from .lora_registry import LoRAModule, LoRARegistry
from .placement import resolve_placement

logger = logging.getLogger(__name__)

# With only KV transfers in flight, how long an idle step waits for one to end (also
# how late a new request may be noticed then).
_TRANSFER_POLL_SECONDS = 0.005


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counters at one moment, typed from the scheduler to /metrics."""

    scheduler: SchedulerStats
    # Which kernel path runs ("native" or "torch").
    kernels: str
    # A copy of the acceptance counters; None without speculative decoding.
    spec_decode: SpecDecodeStats | None = None
    # The KV connector's counters by name (kv_transfer_*, or the disk tier's kv_disk_*); None without one.
    kv_transfer: dict[str, int] | None = None

    def as_dict(self) -> dict:
        """`LLMEngine.stats()`: the scheduler's fields by name, the kernels, then the spec_* and
        kv_transfer_* entries."""
        s = self.scheduler
        return {**{f.name: getattr(s, f.name) for f in fields(s)}, "kernels": self.kernels,
                **(self.spec_decode.as_dict() if self.spec_decode is not None else {}), **(self.kv_transfer or {})}


@dataclass
class _Sequence:
    """One of a request's n samples: its text so far lives with the caller."""

    detokenizer: IncrementalDetokenizer
    finish_reason: str | None = None


@dataclass
class _Tracked:
    """The engine's record of one request (its n samples are the scheduler's Requests)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: dict[int, _Sequence] = field(default_factory=dict)
    num_finished: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled by position as prefill runs
    kv_transfer_params: dict | None = None  # a producer's hand-off, once the request finished
    lora_id: int = 0
    delivered: bool = False  # a delta went out (the first one carries the prompt)
    last_token_delivery: float | None = None  # the time of its last delta with tokens
    pooling: PoolingParams | None = None  # a pooling request's (add_pooling_request), with its pooling_type set
    embedding: list[float] | None = None  # its vector, once its prompt is done

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n

    def finish_reason(self) -> str:
        """The request's: "abort" if any sample was aborted, else sample 0's."""
        reasons = [s.finish_reason for s in self.sequences.values()]
        return "abort" if "abort" in reasons or 0 not in self.sequences else self.sequences[0].finish_reason

    def delta(self, samples: tuple[SampleDelta, ...], now: float, finish_reason: str | None = None) -> RequestDelta:
        """This step's frozen news of the request; the first carries its prompt, the last its
        metrics (`finish_reason` set: an abort, which carries none) and hand-off."""
        first, previous = not self.delivered, self.last_token_delivery
        self.delivered = True
        if any(s.token_ids for s in samples):
            self.last_token_delivery = now
        done = finish_reason is not None or self.finished
        return RequestDelta(
            self.request_id, samples, done, now, self.metrics.arrival_time, len(self.prompt_token_ids), previous,
            finish_reason or (self.finish_reason() if done else None),
            replace(self.metrics) if done and finish_reason is None else None,
            self.prompt if first else None, tuple(self.prompt_token_ids) if first else None,
            tuple(self.prompt_logprobs) if first and self.prompt_logprobs is not None else None,
            self.kv_transfer_params if done else None,
            tuple(self.embedding) if done and self.embedding is not None else None,
        )


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        """`config`: the options as given, resolved here (`self.config` is the ResolvedConfig)."""
        start = time.perf_counter()
        self.placement = placement = resolve_placement(config or EngineConfig(), loaded)
        self.config = config = placement.config
        torch.set_num_threads(config.parallel.rank_num_threads())
        torch.manual_seed(config.serving.seed)
        # Rank 0 of tensor parallelism is this process; the executor starts the other ranks.
        self.tp = TensorParallelExecutor(config) if config.parallel.tensor_parallel_size > 1 else None
        self.kernels = config.device.kernels
        self._parts: dict[str, object] = {}
        try:
            self._build(config, loaded or (self.tp.loaded if self.tp is not None else self._load(config)), start)
        except BaseException:
            self.shutdown()
            raise

    def _load(self, config: ResolvedConfig) -> LoadedModel:
        """The model as load_model reads it: fp32 on the native kernels reads a GGUF's blocks and
        16-bit float weights as stored (the same model)."""
        keeps = self.placement.keeps_loaded_model
        return load_model(config.load.model, quantization=config.load.load_quantization, pack=None if keeps else False,
                          keep_blocks=self.kernels == "native" and keeps and config.load.gguf_weights == "blocks")

    def _build(self, config: ResolvedConfig, loaded: LoadedModel, start: float) -> None:
        parts = self._parts
        parts.update(loaded=loaded, tp=self.tp, keeps_loaded_model=self.placement.keeps_loaded_model)
        build_parts(config, parts)
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.max_model_len: int = parts["max_model_len"]
        self.kv_store = parts["kv_store"]
        self.kv_connector: KVConnectorWorker | None = parts["kv_connector"]
        self.scheduler: Scheduler = parts["scheduler"]
        self.runner: ModelRunner = parts["runner"]
        self.images: ImageEmbedder | None = parts["images"]  # the image encoder and its cache (None: text only)
        self.loras: LoRARegistry | None = parts["loras"]
        self.spec_stats: SpecDecodeStats | None = parts["spec_stats"]
        self.structured_outputs: StructuredOutputManager = parts["structured_outputs"]
        for name, path in config.lora.lora_modules:
            self.add_lora(name, path)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        # The latest step's schedule, for observers on the engine's thread (the dashboard).
        self.last_scheduled: SchedulerOutput | None = None
        # A configured proposer can be paused at run time (the dashboard's playground
        # compares speeds); outputs are the same either way, only their pace changes.
        self.speculate = True
        self._log_ready(parts["kv_plan"], time.perf_counter() - start)

    def _log_ready(self, plan: KVCachePlan, seconds: float) -> None:
        block_size = self.config.kv.block_size
        budget = self.scheduler.config.max_num_batched_tokens
        logger.info(
            "model %s ready in %.1f s; KV cache %.2f GiB = %d blocks of %d tokens (%d tokens); "
            "max_model_len %d; token budget %s; %s kernels; %s KV",
            self.loaded.name, seconds, plan.num_blocks * plan.bytes_per_block / 2**30,
            plan.num_blocks, block_size, plan.num_blocks * block_size, self.max_model_len,
            f"{budget} per step" if self.scheduler.step_budget is None else f"chosen per step, at most {budget}",
            kernel_report(self.kernels) if self.tp is None else ", ".join(self.tp.rank_kernels),
            self.runner.kv_caches[0].dtype,
        )
        logger.info("weights: %s", self.loaded.model.describe_weights())

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks and the KV connector's threads (no-ops without
        them); the engine cannot step after."""
        if self.tp is not None:
            self.tp.shutdown()
        connector = self._parts.get("kv_connector")  # absent when the build failed before it
        if connector is not None:
            connector.shutdown()

    # -- requests in -------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
        lora_name: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> str:
        """Validate, tokenize and queue a request; raise ValueError if it can never run.
        `lora_name` runs it under that loaded LoRA adapter (None: the base model). `images`:
        one per image placeholder of the prompt (`vision.placeholder`), in order (docs/vision.md)."""
        params = params or SamplingParams()
        self.check_task("generate")
        lora_id = self._lora(lora_name).lora_id if lora_name is not None else 0
        params.validate_for_vocab(self.loaded.config.vocab_size)
        prompt_text, prompt_ids, rid = self._prompt(prompt, request_id)
        prompt_ids, spans, pixels = self._expand_images(prompt_ids, images, kv_transfer_params)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise ValueError(
                    f"prompt ({len(prompt_ids)} tokens) leaves no room to generate within max_model_len ({self.max_model_len})"
                )
        # A parallel-sampling parent forks at its first sample, before its matcher has
        # moved, so n fresh matchers are exactly the copies the fork would make.
        matchers: list[Matcher | None] = (
            self.structured_outputs.matchers(params.structured_outputs, params.n)
            if params.structured_outputs is not None else [None] * params.n
        )
        beam = params.beam_width is not None
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            min_tokens=params.min_tokens,
            n=params.beam_width if beam else params.n,
            eos_token_id=self.tokenizer.eos_token_id,
            stop_token_ids=frozenset(params.stop_token_ids) | (self.tokenizer.stop_token_ids if not params.ignore_eos else frozenset()),
            ignore_eos=params.ignore_eos,
            cache_salt=cache_salt,
            lora_id=lora_id,
            skip_prefix_cache=params.prompt_logprobs is not None,
            sampling=beam_sampling_state(params) if beam else SamplingState.for_request(params, matchers),
            kv_transfer_params=kv_transfer_params,
            images=spans,
        )
        if beam:
            request.beam = beam_group(params, max_tokens, request.stop_token_ids, request.eos_token_id)
        self.scheduler.add_request(request)
        if spans:
            self.images.register(rid, [(span.content_hash, p) for span, p in zip(spans, pixels)])
        self._tracked[rid] = _Tracked(rid, prompt_text, prompt_ids, params, RequestMetrics(request.arrival_time),
                                      prompt_logprobs=[None] * len(prompt_ids) if params.prompt_logprobs is not None
                                      else None, lora_id=lora_id)
        return rid

    @property
    def vision(self) -> Idefics3Prompts | None:
        """A vision model's prompt side (`placeholder`, `tokens_per_image(image)`); None: text only."""
        return self.loaded.image_prompts

    def _expand_images(self, prompt_ids: list[int], images: Sequence[ImageInput], kv_transfer_params: dict | None
                       ) -> tuple[list[int], tuple[ImageSpan, ...], list]:
        """The prompt with each image placeholder expanded, the images' spans and their
        tiles; ValueError naming `images` where they cannot run."""
        images = list(images)
        if self.vision is None:
            if images:
                raise ValueError(f"images: model {self.loaded.name} is text-only and takes no images")
            return prompt_ids, (), []
        if images and kv_transfer_params is not None:
            raise ValueError("kv_transfer_params: requests with images are not transferred between prefill and "
                             "decode instances")
        if any(not isinstance(image, ImageInput) for image in images):
            raise ValueError("images: each must be a pagedserve.multimodal.inputs.ImageInput")
        expanded = self.vision.expand(prompt_ids, images)
        spans = tuple(ImageSpan(offset, length, image.content_hash)
                      for (offset, length), image in zip(expanded.spans, images))
        return expanded.token_ids, spans, expanded.pixel_values

    def _prompt(self, prompt: str | list[int], request_id: str | None) -> tuple[str | None, list[int], str]:
        """(text, token ids, request id) of a new request; ValueError for an empty or
        out-of-vocabulary prompt or an id in use."""
        if isinstance(prompt, str):
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, prompt_ids = None, list(prompt)
            vocab = self.loaded.config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._tracked:
            raise ValueError(f"request_id {rid!r} is already in use")
        return prompt_text, prompt_ids, rid

    def check_task(self, task: str) -> None:
        """ValueError when the engine's `task` option does not serve `task` ("generate" or "embed")."""
        if self.config.serving.task not in ("auto", task):
            raise ValueError(f"this engine serves task {self.config.serving.task!r}: {task} requests are off "
                             f"(start it with task 'auto' or {task!r})")

    def add_pooling_request(self, prompt: str | list[int], pooling: PoolingParams | None = None,
                            request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                            arrival_time: float | None = None, lora_name: str | None = None) -> str:
        """Queue a prompt to embed: it is scheduled like any prefill and finishes when its prompt is
        computed, its RequestOutput carrying `embedding` (worker/pooling.py). Prefix-cache hits
        serve "last" pooling (the last token is always recomputed); "mean" and "cls" need hidden
        states the cache does not keep, so they compute every token. ValueError if it can never run."""
        self.check_task("embed")
        pooling = pooling or PoolingParams()
        pooling.validate_for_model(self.loaded.config.hidden_size)
        kind = pooling.pooling_type or self.config.serving.pooling_type
        lora_id = self._lora(lora_name).lora_id if lora_name is not None else 0
        prompt_text, prompt_ids, rid = self._prompt(prompt, request_id)
        # It never samples; a plain state keeps the runner's per-row reads (prompt logprobs, grammar) uniform.
        params = SamplingParams(max_tokens=1)
        request = Request(rid, prompt_ids, max_tokens=1, priority=priority, cache_salt=cache_salt,
                          arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                          lora_id=lora_id, skip_prefix_cache=kind != "last",
                          sampling=SamplingState.for_request(params, [None]), pooling=kind)
        self.scheduler.add_request(request)
        self._tracked[rid] = _Tracked(rid, prompt_text, prompt_ids, params,
                                      RequestMetrics(request.arrival_time), lora_id=lora_id,
                                      pooling=replace(pooling, pooling_type=kind))
        return rid

    def abort(self, request_id: str) -> RequestDelta | None:
        """Abort a request (all its samples) in any state; its blocks are freed at once.
        Its last delta (finish_reason "abort" for each sample still unfinished), or None
        if it was unknown or already finished."""
        tracked = self._tracked.pop(request_id, None)
        self.scheduler.abort(request_id)
        if self.images is not None:
            self.images.release(request_id)
        if tracked is None:
            return None
        done = {i for i, seq in tracked.sequences.items() if seq.finish_reason is not None}
        samples = tuple(SampleDelta(i, "", (), None, "abort", None) for i in range(tracked.params.n) if i not in done)
        return tracked.delta(samples, time.monotonic(), finish_reason="abort")

    def unfinished_request_ids(self) -> list[str]:
        """The requests added and not yet finished or aborted."""
        return list(self._tracked)

    # -- LoRA adapters ------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> LoRAModule:
        """Load a PEFT adapter from `path` under `name`, between steps; ValueError if it cannot be."""
        if self.loras is None:
            raise ValueError("LoRA is not enabled (start the engine with enable_lora)")
        return self.loras.load(name, path)

    def remove_lora(self, name: str) -> LoRAModule:
        """Unload an adapter. Refused (ValueError) while a request that runs it is unfinished:
        its next step would have no weights."""
        module = self._lora(name)
        users = sum(1 for t in self._tracked.values() if t.lora_id == module.lora_id)
        if users:
            raise ValueError(f"LoRA adapter {name!r} has {users} unfinished requests; unload it after they finish")
        return self.loras.unload(name)

    def list_loras(self) -> list[LoRAModule]:
        return self.loras.modules() if self.loras is not None else []

    def _lora(self, name: str) -> LoRAModule:
        if self.loras is None:
            raise ValueError(f"LoRA is not enabled, so there is no adapter {name!r} (start with enable_lora)")
        return self.loras.get(name)

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or KV transfers the engine must keep stepping to hear of."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_connector_work()

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one iteration; a frozen delta for each request it changed, in update order."""
        started = time.perf_counter()
        sched = self.last_scheduled = self.scheduler.schedule()
        now = time.monotonic()
        for row in sched.scheduled:
            if row.is_new:
                tracked = self._tracked.get(row.request.parent_id or row.request_id)
                if tracked is not None and tracked.metrics.first_scheduled_time is None:
                    tracked.metrics.first_scheduled_time = now
        result = self.runner.execute(sched)
        updates = self.scheduler.update(sched, result.sampled, result.beams)
        if self.kv_connector is not None:
            if sched.is_empty and not self.scheduler.running:
                # Only transfers in flight: sleep until one ends instead of spinning.
                self.kv_connector.wait_for_activity(_TRANSFER_POLL_SECONDS)
            updates += self.scheduler.update_connector_output(self.kv_connector.get_finished())
        self.scheduler.observe_step_time(sched, time.perf_counter() - started)
        now = time.monotonic()
        if self.spec_stats is not None:
            for row in sched.scheduled:
                if row.draft_token_ids and row.request_id in result.sampled:
                    self.spec_stats.observe(len(row.draft_token_ids), len(result.sampled[row.request_id]) - 1)
        logprobs = self._logprobs_by_sample(result)
        self._store_prompt_logprobs(result)
        changed: dict[str, tuple[_Tracked, list[SampleDelta]]] = {}
        for update in updates:
            req = update.request
            tracked = self._tracked.get(req.parent_id or req.request_id)
            if tracked is None:
                continue
            samples = changed.setdefault(tracked.request_id, (tracked, []))[1]
            if req.beam is not None:
                samples += self._finish_beam_search(tracked, req, now)
                continue
            if tracked.pooling is not None:
                sample = self._finish_pooling(tracked, req, result.pooled[req.request_id], now)
            else:
                sample = self._apply(tracked, req, update.new_token_ids, update.finished,
                                     logprobs.get((req.parent_id or req.request_id, req.index)), now)
            if sample is not None:
                samples.append(sample)
        if self.runner.speculates and self.speculate:
            self.scheduler.update_draft_token_ids(self.runner.propose_drafts(self.scheduler.running))
        now = time.monotonic()
        deltas = [tracked.delta(tuple(samples), now) for tracked, samples in changed.values()]
        for delta in deltas:
            if delta.finished:
                del self._tracked[delta.request_id]
                if self.images is not None:
                    self.images.release(delta.request_id)
        return deltas

    def _apply(self, tracked: _Tracked, req: Request, new_ids: list[int], finished: RequestStatus | None,
               logprobs: list[TokenLogprobs] | None, now: float) -> SampleDelta | None:
        """Take one sample's update: detokenize, stop, finish; what it adds, if anything."""
        seq = tracked.sequences.get(req.index)
        if seq is None:
            seq = self._new_sequence(tracked, req)
        matcher = req.sampling.matcher
        if matcher is not None and matcher.error:
            # The runner keeps a token the grammar refuses only when no token of the
            # vocabulary continues it, and keeps it last: it is not part of the output.
            logger.warning("request %s: structured output failed: %s", req.request_id, matcher.error)
            new_ids = new_ids[:-1]
            if finished is None:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            finished = RequestStatus.FINISHED_ERROR
        text, stop, new_ids = self._detokenize(seq.detokenizer, new_ids)
        m = tracked.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.num_cached_tokens = req.num_cached_tokens or 0
        m.last_token_time = now
        m.num_preemptions = max(m.num_preemptions, req.num_preemptions)
        if stop is not None and finished is None:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            finished, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if finished is None and matcher is not None and matcher.is_terminated:
            # The grammar is complete: only EOS could follow, which ignore_eos would refuse to stop on.
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            finished = RequestStatus.FINISHED_STOPPED
        if finished is not None:
            if stop is None:
                text += seq.detokenizer.finish()
            seq.finish_reason = finished.finish_reason
            tracked.num_finished += 1
            if tracked.finished:
                m.finished_time = now
                tracked.kv_transfer_params = req.kv_transfer_result
        if not (new_ids or text or finished is not None):
            return None
        wanted = tracked.params.logprobs is not None
        return SampleDelta(req.index, text, tuple(new_ids),
                           (tuple(logprobs[: len(new_ids)]) if logprobs is not None else ()) if wanted else None,
                           seq.finish_reason if finished is not None else None,
                           req.stop_reason if finished is not None else None)

    def _finish_pooling(self, tracked: _Tracked, req: Request, vector: torch.Tensor, now: float) -> SampleDelta:
        """A pooling request's prompt is done: its embedding, and one sample that ends "stop" with no tokens."""
        tracked.embedding = finish_embedding(vector, tracked.pooling)
        self._new_sequence(tracked, req).finish_reason = "stop"
        tracked.num_finished = 1
        m = tracked.metrics
        m.first_token_time = m.last_token_time = m.finished_time = now
        m.num_cached_tokens = req.num_cached_tokens or 0
        m.num_preemptions = req.num_preemptions
        return SampleDelta(req.index, "", (), None, "stop", None)

    def _finish_beam_search(self, tracked: _Tracked, req: Request, now: float) -> list[SampleDelta]:
        """A beam group ended: its best n hypotheses become the request's samples, each whole."""
        samples = []
        for sample, detokenizer in beam_samples(req.beam, tracked.params, self.tokenizer, tracked.prompt_token_ids):
            tracked.sequences[sample.index] = _Sequence(detokenizer, sample.finish_reason)
            samples.append(sample)
        m = tracked.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = m.finished_time = now
        m.num_cached_tokens = req.num_cached_tokens or 0
        m.num_preemptions = req.num_preemptions
        tracked.num_finished = tracked.params.n
        return samples

    @staticmethod
    def _detokenize(detokenizer: IncrementalDetokenizer, new_ids: list[int]) -> tuple[str, str | None, list[int]]:
        """Text delta and stop-string hit for this step's tokens, and the tokens kept:
        with several tokens (accepted drafts) the ones after a stop string are dropped."""
        if len(new_ids) == 1:
            return (*detokenizer.update(new_ids), new_ids)
        text = ""
        for i, token in enumerate(new_ids):
            delta, stop = detokenizer.update([token])
            text += delta
            if stop is not None:
                return text, stop, new_ids[: i + 1]
        return text, None, new_ids

    def _new_sequence(self, tracked: _Tracked, req: Request) -> _Sequence:
        params = tracked.params
        seq = _Sequence(
            IncrementalDetokenizer(
                self.tokenizer,
                tracked.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
        )
        tracked.sequences[req.index] = seq
        return seq

    def _logprobs_by_sample(self, result: RunnerOutput) -> dict[tuple[str, int], list[TokenLogprobs]]:
        """Logprobs rows keyed by (root request id, sample index), in position order
        (several for a speculative row: one per verified position)."""
        lp = result.logprobs
        if lp is None:
            return {}
        out: dict[tuple[str, int], list[TokenLogprobs]] = {}
        ks = [req.sampling.params.logprobs for req, _ in result.logprob_samples]
        for (req, index), entry in zip(result.logprob_samples, self._entries(lp, ks)):
            out.setdefault((req.parent_id or req.request_id, index), []).append(entry)
        return out

    def _store_prompt_logprobs(self, result: RunnerOutput) -> None:
        """Put this step's prompt logprobs in place (by position: a preempted request's
        recomputed prefill writes the same values again)."""
        for chunk in result.prompt_logprobs:
            tracked = self._tracked.get(chunk.request_id)
            if tracked is None or tracked.prompt_logprobs is None:
                continue
            entries = self._entries(chunk.logprobs, itertools.repeat(tracked.params.prompt_logprobs))
            tracked.prompt_logprobs[chunk.first:chunk.first + len(entries)] = entries

    def _entries(self, lp: LogprobsTensors, ks: Iterable[int]) -> list[TokenLogprobs]:
        """Rows of `lp` as {token_id: Logprob}: the row's own token, then its top k."""
        out = []
        ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist()
        for row_ids, row_vals, rank, k in zip(ids, values, ranks, ks):
            entry = {row_ids[0]: Logprob(row_vals[0], rank, self.tokenizer.decode([row_ids[0]]))}
            for r, (tok, val) in enumerate(zip(row_ids[1 : k + 1], row_vals[1 : k + 1]), start=1):
                entry.setdefault(tok, Logprob(val, r, self.tokenizer.decode([tok])))
            out.append(entry)
        return out

    # -- introspection -----------------------------------------------------------------

    def engine_stats(self) -> EngineStats:
        spec = self.spec_stats
        transfers = self.scheduler.transfers.stats()
        return EngineStats(self.scheduler.stats(), self.kernels,
                           replace(spec, accepted_per_pos=list(spec.accepted_per_pos)) if spec is not None else None,
                           {**transfers, **self.kv_connector.stats()} if transfers is not None else None)

    def stats(self) -> dict:
        return self.engine_stats().as_dict()
