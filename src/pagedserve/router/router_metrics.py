"""The router's /metrics: per-replica counters and state, Prometheus text format."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import Response

from .backends import Backend
from .routing_policies import Picker

PREFIX = "pagedserve_router:"


class _BackendCollector(Collector):
    def __init__(self, backends: Sequence[Backend], picker: Picker):
        self._backends = backends
        self._picker = picker

    def collect(self) -> Iterator[Metric]:
        backends = self._backends
        policy = self._picker.policy
        for name, doc, family, value in (
            ("requests", "Requests sent to the replica (retries count again).", CounterMetricFamily,
             lambda b: b.num_requests),
            ("errors", "Connection failures talking to the replica.", CounterMetricFamily, lambda b: b.num_errors),
            ("matched_prefix_tokens", "Prompt tokens the router expected the replica's prefix cache to hold.",
             CounterMetricFamily, lambda b: b.num_matched_tokens),
            ("in_flight", "Requests the router has open at the replica.", GaugeMetricFamily, lambda b: b.in_flight),
            ("healthy", "1 while the replica is routed to.", GaugeMetricFamily, lambda b: int(b.healthy)),
            ("known_cached_blocks", "Block hashes the replica's KV events say it holds.", GaugeMetricFamily,
             lambda b: len(b.cached)),
        ):
            metric = family(PREFIX + name, doc, labels=["backend", "policy"])
            for b in backends:
                metric.add_metric([b.url, policy], value(b))
            yield metric
        fallbacks = CounterMetricFamily(PREFIX + "load_fallbacks",
                                        "cache_aware decisions made by load because replicas were imbalanced.",
                                        labels=["policy"])
        fallbacks.add_metric([policy], self._picker.num_fallbacks)
        yield fallbacks


class RouterMetrics:
    def __init__(self, backends: Sequence[Backend], picker: Picker):
        self.registry = CollectorRegistry()
        self.registry.register(_BackendCollector(backends, picker))
        self.retries = Counter(PREFIX + "retries", "Requests sent again to another replica after a failure.",
                               registry=self.registry)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
