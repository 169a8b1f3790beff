"""Batch lines on /metrics (with --data-dir): queued, running and finished, read at scrape time."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .batch_service import Batches
from .metrics import PREFIX


class BatchCollector(Collector):
    def __init__(self, batches: Batches, model_name: str):
        self._batches = batches
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        pending, finished = self._batches.store.line_states()
        running = 0 if self._batches.runner is None else self._batches.runner.num_running
        labels = ["model_name"]
        queued = GaugeMetricFamily(PREFIX + "batch_lines_queued", "Lines of active batches not yet started.",
                                   labels=labels)
        queued.add_metric([self._model], max(0, pending - running))
        in_flight = GaugeMetricFamily(PREFIX + "batch_lines_running", "Batch lines being served now.", labels=labels)
        in_flight.add_metric([self._model], running)
        done = CounterMetricFamily(PREFIX + "batch_lines_finished", "Batch lines answered (results stored).",
                                   labels=labels)
        done.add_metric([self._model], finished)
        yield from (queued, in_flight, done)
