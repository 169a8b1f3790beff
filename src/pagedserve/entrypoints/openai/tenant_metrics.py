"""Per-tenant series on /metrics (with --api-keys): requests, tokens, refusals by budget, requests
in flight and what is left of each budget, labelled by tenant. Read from the tenants' states
at scrape time, beside the engine-wide series (which stay as they are for dashboards)."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...http.tenants import BUDGETS, Tenants
from .metrics import PREFIX


class TenantCollector(Collector):
    def __init__(self, tenants: Tenants, model_name: str):
        self._tenants = tenants
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "tenant"]
        states = self._tenants.states
        for name, doc, value in (
            ("tenant_requests", "Requests admitted, by tenant.", lambda s: s.requests),
            ("tenant_prompt_tokens", "Prompt tokens of the tenant's requests that reached the engine.",
             lambda s: s.prompt_tokens),
            ("tenant_generation_tokens", "Tokens generated for the tenant.", lambda s: s.generation_tokens),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for tenant, state in states.items():
                counter.add_metric([self._model, tenant], value(state))
            yield counter
        in_flight = GaugeMetricFamily(PREFIX + "tenant_requests_in_flight", "The tenant's requests being served.",
                                      labels=labels)
        refused = CounterMetricFamily(PREFIX + "tenant_rate_limited", "Requests answered 429, by the budget spent.",
                                      labels=[*labels, "budget"])
        remaining = GaugeMetricFamily(PREFIX + "tenant_budget_remaining",
                                      "Requests (rpm) or tokens (tpm) the tenant's bucket holds now; below 0 "
                                      "while it repays tokens charged after admission.", labels=[*labels, "budget"])
        now = self._tenants.clock()
        for tenant, state in states.items():
            in_flight.add_metric([self._model, tenant], state.in_flight)
            for budget in BUDGETS:
                refused.add_metric([self._model, tenant, budget], state.refused[budget])
            for budget, bucket in (("rpm", state.rpm), ("tpm", state.tpm)):
                if bucket is not None:
                    bucket.refill(now)
                    remaining.add_metric([self._model, tenant, budget], bucket.level)
        yield from (in_flight, refused, remaining)
