"""Prometheus metrics, named after vLLM's with the `pagedserve:` prefix.

Latencies and token counts are recorded per engine delivery: `on_step` is one of the
AsyncEngine's step listeners, fed what each delivery's frozen deltas add up to. The engine's gauges and cumulative counters are read from its latest snapshot at scrape
time, so nothing is updated per step that nobody reads. Each app has its own registry.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...engine.async_engine import AsyncEngine, StepStats
from ...spec_decode.acceptance_stats import SpecDecodeStats

PREFIX = "pagedserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Bucket edges in seconds, spanning a fast GPU token (ms) to a long CPU request (minutes).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
_GAUGES = frozenset({"kv_disk_files", "kv_disk_bytes", "kv_disk_capacity_bytes", "kv_disk_writes_disabled"})


class _EngineCollector(Collector):
    """Engine state from the AsyncEngine's latest snapshot."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._engine.snapshot
        labels = ["model_name"]
        for name, doc, value, family in (
            ("num_requests_running", "Requests in the running batch.", snap.num_running, GaugeMetricFamily),
            ("num_requests_waiting", "Requests waiting to be scheduled.", self._engine.num_waiting, GaugeMetricFamily),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", snap.kv_usage,
             GaugeMetricFamily),
            ("num_preemptions", "Preemptions (recompute) since start.", snap.num_preemptions, CounterMetricFamily),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snap.prefix_cache_queries,
             CounterMetricFamily),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", snap.prefix_cache_hits,
             CounterMetricFamily),
        ):
            metric = family(PREFIX + name, doc, labels=labels)
            metric.add_metric([self._model], value)
            yield metric
        if snap.kernels:
            kernels = GaugeMetricFamily(PREFIX + "kernels_info", "Which kernel path runs (native or torch).",
                                        labels=["model_name", "kernels"])
            kernels.add_metric([self._model, snap.kernels], 1)
            yield kernels
        if snap.spec_decode is not None:
            yield from self._spec_decode(snap.spec_decode)
        for name, value in (snap.kv_transfer or {}).items():
            yield self._connector_metric(name, value)

    def _connector_metric(self, name: str, value: int) -> Metric:
        """A KV connector's entry: the P/D connector's kv_transfer_*, the disk tier's kv_disk_*."""
        if name == "kv_disk_read_microseconds":  # Prometheus counts time in seconds
            name, value = "kv_disk_read_seconds", value / 1e6
        # Held, loading and the disk tier's size go up and down; the rest only count up.
        family = GaugeMetricFamily if name in _GAUGES or "_held_" in name or "_loading_" in name \
            else CounterMetricFamily
        what = ("KV disk tier: " + name[8:] if name.startswith("kv_disk_")
                else "KV transfer (disaggregated prefill/decode): " + name[12:])
        metric = family(PREFIX + name, what.replace("_", " "), labels=["model_name"])
        metric.add_metric([self._model], value)
        return metric

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        for name, doc, value in (
            ("spec_decode_num_drafts", "Speculative drafts (one request's proposals in one step).", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ):
            metric = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            metric.add_metric([self._model], value)
            yield metric
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose tokens up to this position were all accepted.",
                                      labels=["model_name", "position"])
        for pos, count in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self._model, str(pos)], count)
        yield per_pos


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._model = model_name
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output steps.",
                             labels, registry=r, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                             registry=r, buckets=_REQUEST_BUCKETS).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", labels,
                                    registry=r, buckets=_REQUEST_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that started generating.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}

    def watch(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineCollector(engine, self._model))

    def on_step(self, stats: StepStats) -> None:
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft, num_prompt_tokens in stats.first_tokens:
            self.ttft.observe(ttft)
            self.prompt_tokens.inc(num_prompt_tokens)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for done in stats.finished:
            self.e2e.observe(done.e2e_latency)
            if done.queue_time is not None:
                self.queue_time.observe(done.queue_time)
            self.success[done.finish_reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
