"""`pagedserve bench serve`: an asyncio + aiohttp streaming load generator for any
OpenAI-compatible server, in the manner of `vllm bench serve`.

Requests leave at gamma-distributed intervals (shape = burstiness, mean = 1 / rate;
burstiness 1 is a Poisson process), at most max_concurrency in flight. Each streamed
chunk is timestamped on arrival; the token count comes from the final usage chunk,
because a server may hold back tokens that end in a partial character and send them
together. The metric arithmetic is sim/metrics.py's, shared with the simulator.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from tqdm.auto import tqdm

from ..workload.datasets import BenchRequest
from ..workload.serving_stats import SLO, RequestRecord, summarize

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    timeout_s: float = 6 * 3600

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times are seconds since the run started."""

    record: RequestRecord
    success: bool = False
    error: str = ""
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)


def send_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each of n requests leaves, in seconds after the start (all 0 for an infinite rate)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def parse_goodput(items: Sequence[str] | None) -> SLO | None:
    """["ttft:500", "tpot:50"] -> SLO in seconds; unnamed targets are not checked."""
    if not items:
        return None
    targets: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput takes KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}; got {item!r}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"goodput {key} must be > 0 ms, got {value!r}")
        targets[key] = ms / 1e3
    return SLO(ttft_s=targets.get("ttft"), itl_s=targets.get("tpot"), e2el_s=targets.get("e2el"))


def _payload(cfg: ServeConfig, model: str, req: BenchRequest, text: str | None) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if req.priority:  # a workload's classes (--priority-every, jsonl), for --scheduling-policy priority
        body["priority"] = req.priority
    if cfg.endpoint == "/v1/completions":
        body["prompt"] = req.prompt_token_ids
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


def _chunk_text(endpoint: str, chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "/v1/completions":
        return choices[0].get("text") or ""
    return (choices[0].get("delta") or {}).get("content") or ""


async def _send(session: aiohttp.ClientSession, url: str, body: dict, out: Outcome, t0: float,
                endpoint: str) -> None:
    rec = out.record
    rec.send_time = time.perf_counter() - t0
    usage_tokens = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                text = _chunk_text(endpoint, chunk)
                if text:
                    out.text += text
                    rec.token_times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return
    if not rec.token_times:
        out.error = out.error or "no tokens streamed"
        return
    rec.num_output_tokens = usage_tokens
    out.success = True


async def fetch_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(base_url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run(cfg: ServeConfig, requests: Sequence[BenchRequest], texts: Sequence[str] | None = None,
              use_tqdm: bool = True) -> tuple[list[Outcome], float, int]:
    """Send every request; (outcomes in dataset order, wall duration in s, peak requests in flight)."""
    if cfg.endpoint == "/v1/chat/completions" and texts is None:
        raise ValueError("chat endpoint needs prompt texts")
    model = cfg.model or await fetch_model(cfg.base_url)
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    offsets = send_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    outcomes = [Outcome(RequestRecord(0.0, r.prompt_len, r.output_len)) for r in requests]
    in_flight = peak = 0
    bar = tqdm(total=len(requests), desc="requests", disable=not use_tqdm)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)

    async def one(i: int, session: aiohttp.ClientSession, t0: float) -> None:
        nonlocal in_flight, peak
        delay = offsets[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            body = _payload(cfg, model, requests[i], texts[i] if texts is not None else None)
            try:
                await _send(session, url, body, outcomes[i], t0, cfg.endpoint)
            finally:
                in_flight -= 1
                bar.update(1)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(one(i, session, t0) for i in range(len(requests))))
        finally:
            bar.close()
        duration = time.perf_counter() - t0
    return outcomes, duration, peak


_SPEC_COUNTER = re.compile(r'^pagedserve:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|'
                           r'num_accepted_tokens_per_pos)_total\{([^}]*)\} (\S+)$', re.M)
_POSITION = re.compile(r'position="(\d+)"')


async def spec_decode_counters(base_url: str) -> dict | None:
    """The server's speculative-decoding counters from /metrics (None when it has none)."""
    try:
        async with aiohttp.ClientSession() as session, session.get(base_url.rstrip("/") + "/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        return None
    return parse_spec_decode_counters(text)


def parse_spec_decode_counters(metrics_text: str) -> dict | None:
    counters: dict = {}
    for name, labels, value in _SPEC_COUNTER.findall(metrics_text):
        position = _POSITION.search(labels)
        if position:
            counters.setdefault("per_pos", {})[int(position.group(1))] = float(value)
        else:
            counters[name] = float(value)
    return counters or None


def spec_decode_delta(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance over the benchmark: the counters' growth between two scrapes."""
    if not before or not after:
        return None
    drafts = after["num_drafts"] - before["num_drafts"]
    proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [after.get("per_pos", {}).get(i, 0) - before.get("per_pos", {}).get(i, 0)
               for i in sorted(after.get("per_pos", {}))]
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_per_pos": [n / drafts if drafts else 0.0 for n in per_pos]}


def summary(outcomes: Sequence[Outcome], duration: float, peak: int, slo: SLO | None,
            percentiles: Sequence[float], spec_decode: dict | None = None) -> dict:
    ok = [o.record for o in outcomes if o.success]
    s = summarize(ok, duration, slo or SLO(None, None, None), percentiles)
    s["successful_requests"] = len(ok)
    s["failed_requests"] = len(outcomes) - len(ok)
    s["peak_concurrency"] = peak
    if slo is None:
        del s["goodput"], s["goodput_requests"]
    else:
        s["request_goodput"] = s["goodput_requests"] / duration
    if spec_decode is not None:
        s["spec_decode"] = spec_decode
    return s


def environment(server_flags: str | None) -> dict:
    """What a result needs to be rerun and compared: the commit of this checkout (None
    outside git), the CPU and its ISA flags, and how the server was started (as the user
    states it: the client cannot see a peer's flags)."""
    from ..kernels import ISA_FLAGS, cpu_flags, cpu_model_name

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    flags = cpu_flags()
    return {"commit": commit, "cpu": cpu_model_name(), "cpu_flags": [f for f in ISA_FLAGS if f in flags],
            "server_flags": server_flags}


def result_json(cfg: ServeConfig, s: dict, outcomes: Sequence[Outcome], server_flags: str | None = None) -> dict:
    return {"config": asdict(cfg), "environment": environment(server_flags), "summary": s,
            "requests": [{"success": o.success, "error": o.error, "send_time": o.record.send_time,
                          "prompt_len": o.record.prompt_len, "requested_output_len": o.record.output_len,
                          "output_tokens": o.record.num_tokens if o.success else 0,
                          "chunk_times": o.record.token_times, "text": o.text} for o in outcomes]}


def format_summary(s: dict, percentiles: Sequence[float]) -> str:
    rows = [("Successful requests", f"{s['successful_requests']}"), ("Failed requests", f"{s['failed_requests']}"),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", f"{s['total_input_tokens']}"),
            ("Total generated tokens", f"{s['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
            ("Peak concurrent requests", f"{s['peak_concurrency']}")]
    if "goodput" in s:
        rows += [("Request goodput (req/s)", f"{s['request_goodput']:.2f}"),
                 ("Goodput (tok/s)", f"{s['goodput']:.2f}")]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {label}", ""))
        rows.append((f"Mean {name.upper()} (ms)", f"{s[f'mean_{name}_ms']:.2f}"))
        rows += [(f"P{q:g} {name.upper()} (ms)", f"{s[f'p{q:g}_{name}_ms']:.2f}") for q in percentiles]
    spec = s.get("spec_decode")
    if spec is not None:
        rows += [("-- Speculative decoding", ""), ("Drafts", f"{spec['drafts']:.0f}"),
                 ("Draft acceptance rate", f"{spec['acceptance_rate']:.1%}"),
                 ("Mean acceptance length", f"{spec['mean_acceptance_length']:.2f}"),
                 ("Acceptance per position", " ".join(f"{r:.2f}" for r in spec["acceptance_per_pos"]))]
    return "\n".join(f"{k:<42}{v:>12}" if v else k for k, v in rows)
