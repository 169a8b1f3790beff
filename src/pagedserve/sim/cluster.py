"""A cluster of simulated instances on one clock: N colocated replicas, xP/yD disaggregated
prefill and decode instances, each of any tensor-parallel degree. Every instance is the
real core Scheduler (with its own KV pool) priced by the roofline cost model, as in
`simulate`; what is new is the traffic between them.

- Colocated (`4r`, `2r:tp2`): a router sends each arrival to the replica with the fewest
  unfinished requests; the replica prefills (chunked) and decodes it.
- Disaggregated (`1p3d`, `2p2d:tp2`): the arrival goes to the least-loaded prefill
  instance as a request for one token (its first token: TTFT ends there). Its KV,
  prompt_len x the model's KV bytes per token, then crosses the link in
  bytes / link bandwidth. The decode instance installs it as cached blocks (the
  prompt's own chained hashes, core/block_hash.py) and admits the request, whose
  prefix hit covers every full block: it computes only the partial tail and decodes.
  A transfer waits at the decode instance while its pool has no room for the blocks.

Simplifications, each small beside the effects studied (docs/scale-out-sim.md): the
prefill side frees its blocks when the prompt is done (in a real system they stay
until the transfer ends), the transfer does not overlap the prefill layer by layer,
and links are not shared: each transfer gets the link's whole bandwidth.
"""
from __future__ import annotations

import heapq
import itertools
import math
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core import Request, Scheduler
from ..core.block_hash import extend_block_hashes
from ..core.scheduler_config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GPU_DEFAULT_MAX_NUM_SEQS,
)
from ..core.scheduler_output import SchedulerOutput
from ..router.routing_policies import CacheAwareConfig, Candidate, Picker
from ..workload.datasets import BenchRequest
from ..workload.serving_stats import SLO, RequestRecord, summarize
from .cost_model import CostModel
from .scenario import Scenario, build_scenario
from .simulator import SAMPLED_TOKEN, arrival_times

# Bytes/s one way between two instances' GPUs: NVLink inside a node (H100/H200, as
# hardware.py's tensor-parallel link), RDMA NICs between nodes.
KV_LINKS: dict[str, float] = {
    "nvlink": 450e9,
    "rdma-400": 400e9 / 8,
    "rdma-100": 100e9 / 8,
}
_LAYOUT = re.compile(r"^(?:(?P<replicas>\d+)r|(?P<p>\d+)p(?P<d>\d+)d)(?::tp(?P<tp>\d+))?$")


@dataclass(frozen=True, slots=True)
class Layout:
    """`4r` four colocated replicas; `1p3d` one prefill and three decode instances; `:tpN`
    makes every instance N-way tensor parallel."""

    name: str
    num_replicas: int = 0
    num_prefill: int = 0
    num_decode: int = 0
    tp: int = 1

    @classmethod
    def parse(cls, spec: str) -> Layout:
        m = _LAYOUT.match(spec.strip())
        if m is None:
            raise ValueError(f"layout must look like 4r, 2r:tp2, 1p3d or 2p2d:tp2; got {spec!r}")
        tp = int(m["tp"] or 1)
        if m["replicas"] is not None:
            layout = cls(spec.strip(), num_replicas=int(m["replicas"]), tp=tp)
        else:
            layout = cls(spec.strip(), num_prefill=int(m["p"]), num_decode=int(m["d"]), tp=tp)
        if tp < 1 or layout.num_instances < 1 or (layout.disaggregated and not (layout.num_prefill and
                                                                              layout.num_decode)):
            raise ValueError(f"layout {spec!r} needs at least one instance of each role and tp >= 1")
        return layout

    @property
    def disaggregated(self) -> bool:
        return self.num_replicas == 0

    @property
    def num_instances(self) -> int:
        return self.num_replicas + self.num_prefill + self.num_decode

    @property
    def num_gpus(self) -> int:
        return self.num_instances * self.tp


@dataclass(frozen=True, slots=True)
class ClusterSetup:
    """What every instance shares besides its tensor-parallel degree."""

    model: str
    hardware: str
    dtype: str = "bf16"
    kv_cache_dtype: str | None = None
    max_num_seqs: int = GPU_DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    link: str = "rdma-100"
    seed: int = 0
    # Each instance's KV pool, as `sim`'s flags (and an engine's options) size it.
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None  # bytes per instance; None: the memory plan's share
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_prefix_caching: bool = True
    # A replica router policy (router/routing_policies.py), as the Ray app's router section sets it;
    # None keeps the simulator's own least-loaded choice.
    policy: str | None = None
    cache: CacheAwareConfig = CacheAwareConfig()

    def __post_init__(self) -> None:
        if self.link not in KV_LINKS:
            raise ValueError(f"link must be one of {', '.join(KV_LINKS)}; got {self.link!r}")

    def scenario(self, tp: int) -> Scenario:
        return build_scenario(self.model, self.hardware, self.dtype, self.kv_cache_dtype, tp, self.block_size,
                              self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                              self.gpu_memory_utilization, self.kv_cache_memory, self.enable_prefix_caching)


@dataclass(eq=False)
class _Instance:
    role: str  # "both", "prefill" or "decode"
    sched: Scheduler
    cost: CostModel
    busy: bool = False
    # Decode side: KV transfers that arrived while the pool had no room, in order.
    incoming: deque = field(default_factory=deque)

    @property
    def load(self) -> int:
        return len(self.sched.requests) + len(self.incoming)


@dataclass(slots=True)
class ClusterResult:
    layout: Layout
    records: list[RequestRecord]
    duration: float
    kv_transfer_bytes: int
    kv_transfer_seconds: float  # summed over transfers
    num_recomputed: int  # decode-side admissions whose installed blocks were evicted first
    # Each instance's scheduler, replicas then prefill then decode (for their accounting).
    schedulers: list[Scheduler] = field(default_factory=list, repr=False)
    # Colocated layouts: the replica each request was routed to, by request index.
    routed: list[int] = field(default_factory=list, repr=False)

    def replica_records(self, k: int) -> list[RequestRecord]:
        """The requests replica `k` (colocated layouts) served."""
        return [r for r, j in zip(self.records, self.routed) if j == k]

    def summary(self, slo: SLO) -> dict[str, float]:
        s = summarize(self.records, self.duration, slo, percentiles=(90,))
        done = [r for r in self.records if r.token_times]
        s["slo_attainment"] = sum(slo.met_by(r) for r in done) / len(self.records) if self.records else math.nan
        s["num_gpus"] = self.layout.num_gpus
        s["kv_transfer_gib"] = self.kv_transfer_bytes / 2**30
        s["num_recomputed"] = self.num_recomputed
        return s


def kv_transfer_seconds(num_tokens: int, kv_bytes_per_token: float, link: str) -> float:
    return num_tokens * kv_bytes_per_token / KV_LINKS[link]


def simulate_cluster(requests: Sequence[BenchRequest], layout: Layout, setup: ClusterSetup,
                     request_rate: float) -> ClusterResult:
    """Run `requests`, Poisson at `request_rate` (inf: all at once), through `layout`."""
    return _ClusterRun(requests, layout, setup, request_rate).run()


class _ClusterRun:
    """One simulation: the instances, the event queue (arrivals, step ends, KV transfers
    reaching a decode instance) and the running totals."""

    def __init__(self, requests: Sequence[BenchRequest], layout: Layout, setup: ClusterSetup, request_rate: float):
        sc = setup.scenario(layout.tp)

        def instance(role: str) -> _Instance:
            return _Instance(role, sc.sim_config("chunked", seed=setup.seed).scheduler(sc.cost), sc.cost)

        self.requests, self.layout, self.link = requests, layout, setup.link
        self.replicas = [instance("both") for _ in range(layout.num_replicas)]
        self.picker = Picker(setup.policy, setup.cache) if setup.policy else None
        self.prefill = [instance("prefill") for _ in range(layout.num_prefill)]
        self.decode = [instance("decode") for _ in range(layout.num_decode)]
        self.arrivals = arrival_times(requests, request_rate, setup.seed)
        self.records = [RequestRecord(self.arrivals[i], r.prompt_len, r.output_len) for i, r in enumerate(requests)]
        self.kv_per_token = sc.cost.kv_bytes_per_token
        self.block_size = sc.block_size
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()  # orders same-time events; also keys the steps in flight
        self.pending: dict[int, tuple[_Instance, SchedulerOutput]] = {}
        self.transfer_bytes, self.transfer_seconds, self.num_recomputed = 0, 0.0, 0
        self.installed: dict[str, int] = {}  # decode request id -> prompt blocks installed for it
        self.routed = [-1] * len(requests) if layout.num_replicas else []

    def run(self) -> ClusterResult:
        for i, t in enumerate(self.arrivals):
            self._push(t, "arrive", i)
        handlers = {"arrive": self._arrive, "step": self._step_done, "transferred": self._transferred}
        t = 0.0
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](payload, t)
        return ClusterResult(self.layout, self.records, max(t, 1e-9), self.transfer_bytes, self.transfer_seconds,
                             self.num_recomputed, [x.sched for x in self.replicas + self.prefill + self.decode],
                             self.routed)

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def _arrive(self, i: int, t: float) -> None:
        req = self.requests[i]
        if self.layout.disaggregated:
            target = _least_loaded(self.prefill)
            target.sched.add_request(Request(str(i), list(req.prompt_token_ids), 1, arrival_time=t, ignore_eos=True))
        else:
            request = Request(str(i), list(req.prompt_token_ids), req.output_len, arrival_time=t, ignore_eos=True)
            target = self._route(request)
            target.sched.add_request(request)
        self._kick(target, t)

    def _route(self, request: Request) -> _Instance:
        """The replica the router's policy picks; cache_aware sees each replica's real prefix
        cache, where the Ray app sees reported block hashes a stats period old."""
        if self.picker is None:
            k = self.replicas.index(_least_loaded(self.replicas))
        else:
            candidates = [Candidate(k, r.load, r.sched.kv_cache.find_prefix_hit(request).num_tokens
                                    if self.picker.needs_keys else 0) for k, r in enumerate(self.replicas)]
            k = self.picker.pick(candidates, len(request.prompt_token_ids)).index
        self.routed[int(request.request_id)] = k
        return self.replicas[k]

    def _step_done(self, key: int, t: float) -> None:
        inst, out = self.pending.pop(key)
        inst.busy = False
        sampled = {r.request_id: [SAMPLED_TOKEN] * r.num_samples for r in out.scheduled if r.num_samples}
        for u in inst.sched.update(out, sampled):
            i = int(u.request_id)
            self.records[i].token_times.append(t)
            if u.finished is None:
                continue
            self.records[i].num_preemptions += u.request.num_preemptions
            if inst.role == "prefill" and self.requests[i].output_len > 1:
                prompt_len = self.requests[i].prompt_len
                seconds = kv_transfer_seconds(prompt_len, self.kv_per_token, self.link)
                self.transfer_bytes += int(prompt_len * self.kv_per_token)
                self.transfer_seconds += seconds
                self._push(t + seconds, "transferred", i)
            elif inst.role == "decode":
                blocks = self.installed.pop(u.request_id)
                cached = u.request.num_cached_tokens
                if cached is not None and cached < blocks * self.block_size:
                    self.num_recomputed += 1
        if inst.role == "decode":
            self._try_install(inst, t)
        self._kick(inst, t)

    def _transferred(self, i: int, t: float) -> None:
        d = _least_loaded(self.decode)
        d.incoming.append(i)
        self._try_install(d, t)

    def _kick(self, inst: _Instance, t: float) -> None:
        """Start the instance's next step if it is idle and has work."""
        if inst.busy or not inst.sched.has_unfinished_requests():
            return
        out = inst.sched.schedule()
        if out.is_empty:
            raise AssertionError(f"an instance made no progress at t={t:.3f}s with work pending")
        inst.busy = True
        key = next(self.seq)
        self.pending[key] = (inst, out)
        self._push(t + inst.cost.step_seconds(out), "step", key)

    def _try_install(self, d: _Instance, t: float) -> None:
        """Admit transferred requests while the decode pool has room for their blocks."""
        while d.incoming:
            i = d.incoming[0]
            req = self.requests[i]
            tokens = req.prompt_token_ids + [SAMPLED_TOKEN]
            num_blocks = req.prompt_len // self.block_size
            if not _install_blocks(d.sched, tokens, num_blocks, self.block_size):
                return
            d.incoming.popleft()
            self.installed[str(i)] = num_blocks
            d.sched.add_request(Request(str(i), tokens, req.output_len - 1, arrival_time=t, ignore_eos=True))
        self._kick(d, t)


def _least_loaded(group: list[_Instance]) -> _Instance:
    return min(group, key=lambda x: x.load)


def _install_blocks(sched: Scheduler, token_ids: list[int], num_blocks: int, block_size: int) -> bool:
    """Put a transferred prompt's first `num_blocks` blocks into the decode instance's prefix
    cache, as free cached blocks at the back of the eviction queue; False (nothing changed)
    when it has no room. Blocks it holds already are kept, not sent again."""
    return sched.kv_cache.install_cached_prefix(extend_block_hashes([], token_ids, block_size, num_blocks, None))


def max_goodput(requests: Sequence[BenchRequest], layout: Layout, setup: ClusterSetup, slo: SLO,
                attainment: float = 0.9, lo: float = 0.05, hi: float = 512.0, iterations: int = 10) -> float:
    """The highest Poisson rate (requests/s) at which `attainment` of the requests meet `slo`
    (DistServe's goodput), by bisection in log space; 0.0 if even `lo` misses."""
    def ok(rate: float) -> bool:
        return simulate_cluster(requests, layout, setup, rate).summary(slo)["slo_attainment"] >= attainment

    if not ok(lo):
        return 0.0
    if ok(hi):  # the whole range passes: the workload is too light to tell
        return hi
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
