"""The discrete-event loop: the real Scheduler (and its KVCacheManager) steps through a
workload while the cost model, not a model, says how long each step takes.

Clients send requests by the workload's arrival times (all at t = 0 unless a request
carries one or `request_rate` draws Poisson gaps) through a closed loop of
`concurrency` slots: a request is sent at max(its arrival, the earliest time a slot is
free), like a benchmark client with max-concurrency. The engine sees a request at the
first step boundary after it was sent; its TTFT counts from the send time.
"""
from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core import CacheConfig, Request, Scheduler, SchedulerConfig
from ..core.contiguous_kv import ContiguousKVCacheManager, ContiguousLayout
from ..core.scheduler_config import (
    CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GPU_DEFAULT_MAX_NUM_SEQS,
)
from ..core.step_budget import LatencyTarget, PromptSupply, StepBudget
from ..core.validation import is_int
from ..engine_config import check_latency_target_policy
from ..workload.datasets import BenchRequest
from ..workload.serving_stats import CLASS_TTFT, SLO, RequestRecord, summarize
from .cost_model import CostModel

SAMPLED_TOKEN = 1  # every simulated sample; requests ignore EOS so only lengths matter


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: str = "chunked"
    num_blocks: int = 4096
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = GPU_DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    # Budget each step from these latency targets (core/step_budget.py) instead of the
    # fixed max_num_batched_tokens, which then is the cap.
    itl_target_ms: float | None = None
    ttft_target_ms: float | None = None
    # Without itl_target_ms: the automatic target, a step beside decodes within this
    # many times their decode-only time (the engine's default, core.step_budget.AUTO_ITL_RATIO).
    itl_ratio: float | None = None
    # The contiguous KV layout's regions and page budget; None: the paged pool of num_blocks.
    # It has no prefix cache, so enable_prefix_caching does not apply.
    contiguous: ContiguousLayout | None = None
    # Who goes first and who is preempted (core/request_queue.py): requests carry their priority.
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.concurrency is not None and (not is_int(self.concurrency) or self.concurrency < 1):
            raise ValueError(f"concurrency must be an integer >= 1 or None, got {self.concurrency!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate!r}")
        if self.has_latency_target:
            check_latency_target_policy(self.policy, enable_chunked_prefill=True)

    @property
    def has_latency_target(self) -> bool:
        return self.itl_target_ms is not None or self.ttft_target_ms is not None or self.itl_ratio is not None

    def scheduler(self, cost: CostModel | None = None) -> Scheduler:
        """`cost` prices the latency target's steps (needed when one is set)."""
        budget = None
        if self.has_latency_target:
            if cost is None:
                raise ValueError("a latency target needs the cost model to predict step times")
            target = LatencyTarget(ms_to_s(self.itl_target_ms), ms_to_s(self.ttft_target_ms), itl_ratio=self.itl_ratio)
            cap = self.max_num_batched_tokens
            budget = StepBudget(cost.step_time_model(cap), target, cap,
                                supply=PromptSupply(CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS))
        cache = CacheConfig(num_blocks=self.num_blocks, block_size=self.block_size,
                            enable_prefix_caching=self.enable_prefix_caching and self.contiguous is None)
        return Scheduler(
            SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                            max_model_len=self.max_model_len, policy=self.policy,
                            long_prefill_token_threshold=self.long_prefill_token_threshold,
                            scheduling_policy=self.scheduling_policy),
            cache, budget,
            # No OS here: the page arithmetic is the committed figure.
            kv_cache=ContiguousKVCacheManager(cache, self.contiguous, None) if self.contiguous is not None else None,
        )


@dataclass(frozen=True, slots=True)
class StepRecord:
    start: float
    duration: float
    prefill_tokens: int
    decode_rows: int
    padding_rows: int
    kv_usage: float
    kv_waste: float
    num_waiting: int


@dataclass(slots=True)
class SimResult:
    policy: str
    records: list[RequestRecord]
    steps: list[StepRecord]
    duration: float
    num_preemptions: int
    num_blocks: int
    scheduler: Scheduler = field(repr=False)

    def summary(self, slo: SLO = SLO()) -> dict[str, float]:
        s = summarize(self.records, self.duration, slo)
        busy = [st for st in self.steps if st.kv_usage > 0]
        # Time-weighted, so long prefill steps count for as long as they last.
        weight = sum(st.duration for st in busy) or 1.0
        s["mean_kv_usage"] = sum(st.kv_usage * st.duration for st in busy) / weight
        s["max_kv_usage"] = max((st.kv_usage for st in busy), default=0.0)
        s["kv_waste"] = sum(st.kv_waste * st.duration for st in busy) / weight
        s["num_preemptions"] = self.num_preemptions
        s["num_steps"] = len(self.steps)
        classes = sorted({r.priority for r in self.records})
        if len(classes) > 1:
            for p in classes:
                s[f"{CLASS_TTFT}{p}"] = summarize([r for r in self.records if r.priority == p],
                                                  self.duration)["p99_ttft_ms"]
        return s


def ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def arrival_times(requests: Sequence[BenchRequest], request_rate: float, seed: int) -> list[float]:
    """Each request's own arrival_time if set, else Poisson arrivals at request_rate (inf: all at 0)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for r in requests:
        if r.arrival_time is not None:
            out.append(r.arrival_time)
            continue
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        out.append(t if math.isfinite(request_rate) else 0.0)
    return out


def simulate(requests: Sequence[BenchRequest], cost: CostModel, config: SimConfig) -> SimResult:
    sched = config.scheduler(cost)
    arrivals = arrival_times(requests, config.request_rate, config.seed)
    order = sorted(range(len(requests)), key=arrivals.__getitem__)
    slots = [0.0] * min(config.concurrency or len(requests), len(requests))  # a heap of free-slot times
    records: dict[str, RequestRecord] = {}
    steps: list[StepRecord] = []
    t = 0.0
    nxt = 0
    # A measured machine's steps vary (Hardware.step_spread): each takes its price times a
    # factor drawn from the measured ones, from its own stream so arrivals stay the same.
    spread = cost.hardware.step_spread
    spread_rng = random.Random(f"{config.seed}:step-spread")
    while True:
        while nxt < len(order) and slots and max(arrivals[order[nxt]], slots[0]) <= t:
            i = order[nxt]
            send = max(arrivals[i], heapq.heappop(slots))
            req = requests[i]
            rid = str(i)
            sched.add_request(Request(rid, req.prompt_token_ids, req.output_len, arrival_time=send, ignore_eos=True,
                                      priority=req.priority))
            records[rid] = RequestRecord(send, req.prompt_len, req.output_len, priority=req.priority)
            nxt += 1
        if not sched.has_unfinished_requests():
            if nxt == len(order):
                break
            t = max(arrivals[order[nxt]], slots[0])
            continue
        out = sched.schedule()
        if out.is_empty:
            raise AssertionError(f"the scheduler made no progress at t={t:.3f}s with work pending")
        prefill = decode = padding = 0
        for r in out.scheduled:
            if r.is_padding:
                padding += 1
            elif r.is_decode:
                decode += 1
            else:
                prefill += r.num_new_tokens
        seconds = cost.step_seconds(out)
        if spread:
            seconds *= spread[spread_rng.randrange(len(spread))]
        sched.observe_step_time(out, seconds)
        stats = sched.stats()
        steps.append(StepRecord(t, seconds, prefill, decode, padding, stats.kv_usage, stats.kv_waste,
                                stats.num_waiting))
        t += seconds
        sampled = {r.request_id: [SAMPLED_TOKEN] * r.num_samples for r in out.scheduled if r.num_samples}
        for u in sched.update(out, sampled):
            rec = records[u.request_id]
            rec.token_times.append(t)
            if u.finished is not None:
                rec.num_preemptions = u.request.num_preemptions
                heapq.heappush(slots, t)
    return SimResult(config.policy, list(records.values()), steps, t, sched.num_preemptions,
                     config.num_blocks, sched)
