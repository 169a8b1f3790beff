"""Latency and throughput arithmetic shared by the simulator and the twin check.

Definitions follow `vllm bench serve`: TTFT = first token time - send time; ITL = gap
between consecutive tokens of one request (all gaps of all requests pooled);
TPOT = (last - first token) / (outputs - 1) per request. Percentiles interpolate
linearly between order statistics (numpy's default). Goodput, as the seed defines
it: output tokens per second from requests that met both their TTFT target and their
ITL target (the request's TPOT, its mean ITL, at most the ITL target), and its
end-to-end latency target when one is set. A target of None is not checked.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

# How the simulator's and the benchmarks' tables print a summary figure: key -> (title, format).
SUMMARY_FORMATS: dict[str, tuple[str, str]] = {
    "output_throughput": ("output tok/s", "{:,.0f}"),
    "mean_ttft_ms": ("mean TTFT ms", "{:,.0f}"),
    "p99_ttft_ms": ("p99 TTFT ms", "{:,.0f}"),
    "mean_itl_ms": ("mean ITL ms", "{:.1f}"),
    "p99_itl_ms": ("p99 ITL ms", "{:.1f}"),
    "goodput": ("goodput tok/s", "{:,.0f}"),
    "mean_kv_usage": ("KV use", "{:.0%}"),
    "kv_waste": ("KV waste", "{:.2%}"),
    "peak_blocks_used": ("peak blocks", "{:d}"),
    "num_preemptions": ("preempt", "{:d}"),
}


def summary_columns(keys: Sequence[str], **formats: str) -> tuple[tuple[str, str, str], ...]:
    """(title, key, format) per key, in order; `formats` overrides a key's format."""
    return tuple((SUMMARY_FORMATS[k][0], k, formats.get(k, SUMMARY_FORMATS[k][1])) for k in keys)


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100]; linear interpolation between the closest ranks; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# A simulated summary's p99 TTFT of one priority class (when a workload has several): this + the class.
CLASS_TTFT = "p99_ttft_ms_priority_"


@dataclass(slots=True)
class RequestRecord:
    send_time: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Tokens produced, when a stream delivered some of them together (an HTTP server
    # holds back a partial character); None: one token per entry of token_times.
    num_output_tokens: int | None = None
    priority: int = 0  # the request's class (lower first), for per-class figures

    @property
    def num_tokens(self) -> int:
        return len(self.token_times) if self.num_output_tokens is None else self.num_output_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        t, n = self.token_times, self.num_tokens
        return (t[-1] - t[0]) / (n - 1) if t and n > 1 else None

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.send_time


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float | None = 2.0
    itl_s: float | None = 0.1
    e2el_s: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        tpot = r.tpot
        return ((self.ttft_s is None or r.ttft <= self.ttft_s)
                and (self.itl_s is None or tpot is None or tpot <= self.itl_s)
                and (self.e2el_s is None or r.e2el <= self.e2el_s))


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO = SLO(),
              percentiles: Sequence[float] = ()) -> dict[str, float]:
    """The benchmark summary for finished requests over `duration` seconds of wall (or simulated) time.
    Each q in `percentiles` adds p{q}_{ttft,tpot,itl,e2el}_ms (e.g. p50_ttft_ms)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration!r}")
    done = [r for r in records if r.token_times]
    ttfts = [r.ttft for r in done]
    itls = [x for r in done for x in r.itls]
    tpots = [t for r in done if (t := r.tpot) is not None]
    out_tokens = sum(r.num_tokens for r in done)
    e2els = [r.e2el for r in done]
    good = [r for r in done if slo.met_by(r)]
    ms = 1e3

    def mean(xs: Sequence[float]) -> float:
        return statistics.fmean(xs) if xs else math.nan

    out = {
        "completed": len(done),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in done)) / duration,
        "mean_ttft_ms": mean(ttfts) * ms,
        "median_ttft_ms": percentile(ttfts, 50) * ms,
        "p99_ttft_ms": percentile(ttfts, 99) * ms,
        "mean_tpot_ms": mean(tpots) * ms,
        "p99_tpot_ms": percentile(tpots, 99) * ms,
        "mean_itl_ms": mean(itls) * ms,
        "median_itl_ms": percentile(itls, 50) * ms,
        "p99_itl_ms": percentile(itls, 99) * ms,
        "goodput": sum(r.num_tokens for r in good) / duration,
        "goodput_requests": len(good),
        "mean_e2el_ms": mean(e2els) * ms,
        "median_e2el_ms": percentile(e2els, 50) * ms,
        "p99_e2el_ms": percentile(e2els, 99) * ms,
    }
    for q in percentiles:
        for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
            out[f"p{q:g}_{name}_ms"] = percentile(xs, q) * ms
    return out
