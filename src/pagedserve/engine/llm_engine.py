"""The step loop: schedule -> run the model -> sample -> update -> detokenize.

The engine owns what the core does not: tokenisation, sampling state (seeded
generators, parallel-sampling forks), incremental detokenisation with stop
strings, per-request metrics and the RequestOutputs handed to callers.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from ..config import EngineConfig, default_kv_cache_memory, default_num_threads
from ..core.config import CacheConfig, SchedulerConfig
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler
from ..model.loader import LoadedModel, load_model
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from ..sampling_params import SamplingParams, child_seed
from ..spec_decode.config import SpeculativeConfig
from ..spec_decode.draft_model import DraftModelProposer, scratch_blocks_per_seq
from ..spec_decode.metrics import SpecDecodeStats
from ..spec_decode.ngram import NgramProposer
from ..structured_output.backend import Matcher
from ..structured_output.manager import StructuredOutputManager
from ..worker.model_runner import ModelRunner, RunnerOutput, allocate_kv_caches
from .detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class SamplingState:
    """Stored in core's opaque `Request.sampling`: what the runner needs to sample a row."""

    params: SamplingParams
    # A seeded random sample draws output token t from token_seed(seed, t); None otherwise.
    seed: int | None
    # At a parallel-sampling fork, sample i has seed fork_seeds[i].
    fork_seeds: list[int | None] = field(default_factory=list)
    # The grammar matcher of a structured-output request (None otherwise); at a fork,
    # sample i advances fork_matchers[i].
    matcher: Matcher | None = None
    fork_matchers: list[Matcher | None] = field(default_factory=list)


def _seeds(params: SamplingParams) -> list[int | None]:
    if params.seed is None or params.is_greedy:
        return [None] * params.n
    return [child_seed(params.seed, i) for i in range(params.n)]


@dataclass
class _Sequence:
    """One of a request's n samples, as the caller sees it."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer


@dataclass
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: dict[int, _Sequence] = field(default_factory=dict)
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        torch.set_num_threads(config.num_threads or default_num_threads())
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)

        spec = config.speculative_config
        draft = self._load_draft(spec)
        kv_memory = config.kv_cache_memory or default_kv_cache_memory()
        bytes_per_block = mc.kv_bytes_per_token() * config.block_size
        self_layers = spec.self_draft_layers if spec is not None else None
        separate_draft = draft is not None and self_layers is None
        if separate_draft:
            bytes_per_block += draft.config.kv_bytes_per_token() * config.block_size
        # A draft model writes unverified positions into runner-private scratch blocks
        # of the layers it runs: the target's first N (self-draft) or its own.
        num_scratch, scratch_bytes = 0, 0
        if draft is not None:
            drafting_seqs = min(config.max_num_seqs, spec.disable_by_batch_size or config.max_num_seqs)
            num_scratch = drafting_seqs * scratch_blocks_per_seq(config.block_size, spec.num_speculative_tokens)
            draft_kv = draft.config.kv_bytes_per_token()
            if self_layers is not None:
                draft_kv = draft_kv * self_layers // mc.num_layers
            scratch_bytes = num_scratch * draft_kv * config.block_size
        num_blocks = (kv_memory - scratch_bytes) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({kv_memory} bytes) is below one KV block ({bytes_per_block} bytes)"
                             + (f" plus {scratch_bytes} bytes of draft scratch" if scratch_bytes else ""))
        budget = config.effective_max_num_batched_tokens(self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                scheduling_policy=config.scheduling_policy,
                policy=config.policy,
            ),
            CacheConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
        )
        self.runner = ModelRunner(
            self.loaded.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.tokenizer.stop_token_ids),
            attention_backend=config.attention_backend,
            num_scratch_blocks=num_scratch if self_layers is not None else 0,
            num_scratch_layers=self_layers or 0,
        )
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec is not None else None
        self._propose = None
        if spec is not None and spec.method == "ngram":
            self._propose = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max).propose
        elif draft is not None:
            runner = self.runner
            runner.drafter = DraftModelProposer(
                draft.model,
                allocate_kv_caches(draft.model, num_blocks + num_scratch, config.block_size) if separate_draft
                else runner.kv_caches[:self_layers],
                runner.block_tables, runner.backend, config.block_size, spec.num_speculative_tokens,
                scratch_start=num_blocks, max_num_seqs=drafting_seqs, shares_target_cache=not separate_draft,
            )
            self._propose = runner.propose_drafts
        self.structured_outputs = StructuredOutputManager(self.tokenizer, mc.vocab_size)
        self._tracked: dict[str, _Tracked] = {}
        self._streamed: list[CompletionOutput] = []  # outputs whose deltas the last step set
        self._ids = itertools.count()
        logger.info(
            "model %s ready in %.1f s; KV cache %.2f GiB = %d blocks of %d tokens (%d tokens); "
            "max_model_len %d; token budget %d per step",
            self.loaded.name, time.perf_counter() - start, num_blocks * bytes_per_block / 2**30, num_blocks,
            config.block_size, num_blocks * config.block_size, self.max_model_len, budget,
        )

    def _load_draft(self, spec: SpeculativeConfig | None) -> LoadedModel | None:
        """The draft model: the target itself for "self:N", else a model sharing its tokenizer."""
        if spec is None or spec.method != "draft_model":
            return None
        layers = spec.self_draft_layers
        if layers is not None:
            if layers >= self.loaded.config.num_layers:
                raise ValueError(f'speculative_config.model "self:{layers}" must use fewer layers than the '
                                 f"target's {self.loaded.config.num_layers}")
            return self.loaded
        draft = load_model(spec.model)
        probe = "Speculative decoding needs one vocabulary: ¿sí? 123 <|im_end|>"
        if (draft.config.vocab_size != self.loaded.config.vocab_size
                or draft.tokenizer.encode(probe) != self.tokenizer.encode(probe)
                or draft.tokenizer.eos_token_id != self.tokenizer.eos_token_id):
            raise ValueError(f"speculative_config.model {spec.model!r} does not share the target's tokenizer "
                             f"(vocab {draft.config.vocab_size} vs {self.loaded.config.vocab_size})")
        return draft

    # -- requests in -------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate, tokenize and queue a request; raise ValueError if it can never run."""
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported by this engine")
        params.validate_for_vocab(self.loaded.config.vocab_size)
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
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise ValueError(
                    f"prompt ({len(prompt_ids)} tokens) leaves no room to generate within max_model_len ({self.max_model_len})"
                )
        seeds = _seeds(params)
        # A parallel-sampling parent forks at its first sample, before its matcher has
        # moved, so n fresh matchers are exactly the copies the fork would make.
        matchers: list[Matcher | None] = (
            self.structured_outputs.matchers(params.structured_outputs, params.n)
            if params.structured_outputs is not None else [None] * params.n
        )
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            min_tokens=params.min_tokens,
            n=params.n,
            eos_token_id=self.tokenizer.eos_token_id,
            stop_token_ids=frozenset(params.stop_token_ids) | (self.tokenizer.stop_token_ids if not params.ignore_eos else frozenset()),
            ignore_eos=params.ignore_eos,
            cache_salt=cache_salt,
            sampling=SamplingState(params, seeds[0], seeds, matchers[0], matchers),
        )
        self.scheduler.add_request(request)
        self._tracked[rid] = _Tracked(rid, prompt_text, prompt_ids, params, RequestMetrics(request.arrival_time))
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its samples) in any state; its blocks are freed at once."""
        tracked = self._tracked.pop(request_id, None)
        self.scheduler.abort(request_id)
        return tracked is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration. The RequestOutputs returned hold live objects: their
        `delta_*` fields describe this step and are valid until the next step()."""
        for seq in self._streamed:
            seq.delta_text, seq.delta_token_ids = "", []
        self._streamed = []
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for row in sched.scheduled:
            if row.is_new:
                tracked = self._tracked.get(row.request.parent_id or row.request_id)
                if tracked is not None and tracked.metrics.first_scheduled_time is None:
                    tracked.metrics.first_scheduled_time = now
        result = self.runner.execute(sched)
        updates = self.scheduler.update(sched, result.sampled)
        now = time.monotonic()
        if self.spec_stats is not None:
            for row in sched.scheduled:
                if row.draft_token_ids and row.request_id in result.sampled:
                    self.spec_stats.observe(len(row.draft_token_ids), len(result.sampled[row.request_id]) - 1)
        logprobs = self._logprobs_by_sample(result)
        changed: dict[str, _Tracked] = {}
        for update in updates:
            req = update.request
            tracked = self._tracked.get(req.parent_id or req.request_id)
            if tracked is None:
                continue
            self._apply(tracked, req, update.new_token_ids, update.finished, logprobs.get((req.parent_id or req.request_id, req.index)), now)
            changed[tracked.request_id] = tracked
        if self._propose is not None:
            self._propose_drafts()
        return [self._output(t) for t in changed.values()]

    def _propose_drafts(self) -> None:
        """Give every running decode proposals for the next step (unless the batch is
        past disable_by_batch_size, where verification would cost more than it saves)."""
        running = self.scheduler.running
        limit = self.config.speculative_config.disable_by_batch_size
        if not running or (limit and len(running) > limit):
            return
        decodes = [r for r in running
                   if r.num_tokens - r.num_computed_tokens == 1 and r.max_tokens - r.num_output_tokens > 1]
        for req, drafts in zip(decodes, self._propose(decodes)):
            req.spec_token_ids = drafts

    def _apply(self, tracked: _Tracked, req: Request, new_ids: list[int], finished: RequestStatus | None,
               logprobs: list[TokenLogprobs] | None, now: float) -> None:
        seq = tracked.sequences.get(req.index)
        if seq is None:
            seq = self._new_sequence(tracked, req)
        out = seq.output
        self._streamed.append(out)
        delta, stop, new_ids = self._detokenize(seq.detokenizer, new_ids)
        out.token_ids.extend(new_ids)
        out.delta_token_ids.extend(new_ids)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.extend(logprobs[: len(new_ids)])
        m = tracked.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.num_cached_tokens = req.num_cached_tokens or 0
        m.last_token_time = now
        m.num_preemptions = max(m.num_preemptions, req.num_preemptions)
        out.text += delta
        out.delta_text += delta
        if stop is not None and finished is None:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            finished, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        matcher = req.sampling.matcher
        if finished is None and matcher is not None and matcher.is_terminated:
            # The grammar is complete (only EOS could follow, which ignore_eos would
            # refuse to stop on) or its matcher failed: either way nothing more can come.
            if matcher.error:
                logger.warning("request %s: structured output failed: %s", req.request_id, matcher.error)
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            finished = RequestStatus.FINISHED_STOPPED
        if finished is not None:
            if stop is None:
                tail = seq.detokenizer.finish()
                out.text += tail
                out.delta_text += tail
            out.finish_reason = finished.finish_reason
            out.stop_reason = req.stop_reason
            tracked.num_finished += 1
            if tracked.finished:
                m.finished_time = now

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
        if req.index > 0:
            # A freshly forked child: from now on it samples with its own seed.
            parent_state: SamplingState = req.sampling
            req.sampling = SamplingState(params, parent_state.fork_seeds[req.index],
                                         matcher=parent_state.fork_matchers[req.index])
        seq = _Sequence(
            CompletionOutput(index=req.index, logprobs=[] if params.logprobs is not None else None),
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
        ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist()
        for (req, index), row_ids, row_vals, rank in zip(result.logprob_samples, ids, values, ranks):
            k = req.sampling.params.logprobs
            entry = {row_ids[0]: Logprob(row_vals[0], rank, self.tokenizer.decode([row_ids[0]]))}
            for r, (tok, val) in enumerate(zip(row_ids[1 : k + 1], row_vals[1 : k + 1]), start=1):
                entry.setdefault(tok, Logprob(val, r, self.tokenizer.decode([tok])))
            out.setdefault((req.parent_id or req.request_id, index), []).append(entry)
        return out

    def _output(self, tracked: _Tracked) -> RequestOutput:
        outputs = [tracked.sequences[i].output for i in sorted(tracked.sequences)]
        if tracked.finished:
            del self._tracked[tracked.request_id]
        return RequestOutput(
            tracked.request_id, tracked.prompt, tracked.prompt_token_ids, outputs, tracked.finished, tracked.metrics
        )

    # -- introspection -----------------------------------------------------------------

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {
            "kv_total_blocks": s.kv_total_blocks,
            "kv_free_blocks": s.kv_free_blocks,
            "kv_usage": s.kv_usage,
            "kv_waste": s.kv_waste,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            **(self.spec_stats.as_dict() if self.spec_stats is not None else {}),
        }
