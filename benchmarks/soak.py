"""Soak: a mixed workload against a real server for a set time, sampling its health.

Clients loop over plain, streamed, n > 1, structured, speculative (the server runs
n-gram speculation), aborted (hang up mid-stream) and bad requests. Every
`--interval` seconds the server's RSS, open file descriptors, threads, KV usage and the
window's p99 latency are sampled. At the end: counts by status, the least-squares slope
of each resource over the run, and the engine state after the last request (every
block back, nothing running or waiting). Exits 1 on any 5xx, transport error, leak or
an RSS slope over the run's second half above `--max-rss-slope-mib-per-min`.

    python benchmarks/soak.py --duration 1200 --out results/soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

SERVER_FLAGS = ("--kv-cache-memory", "128MiB", "--max-model-len", "512", "--max-queued-requests", "64",
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning")
KINDS = ("plain", "stream", "n>1", "structured", "speculative", "abort", "bad")


@dataclass
class Sample:
    t: float  # seconds since the start
    rss_mib: float
    fds: int
    threads: int
    kv_usage: float
    p99_s: float | None  # of the requests that finished in this window
    requests: int


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    window_latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def _engine_gauges(client: httpx.Client) -> dict[str, float]:
    wanted = {"pagedserve:kv_cache_usage_perc", "pagedserve:num_requests_running", "pagedserve:num_requests_waiting"}
    return {s.name.split(":")[1]: s.value for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples if s.name in wanted}


def _request(kind: str, rng: random.Random) -> tuple[str, dict]:
    tokens = rng.randint(8, 48)
    if kind == "n>1":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a fact."}], "n": 3,
                                        "max_tokens": tokens, "temperature": 0.9}
    if kind == "structured":
        return "/v1/completions", {"prompt": "A person as JSON:", "max_tokens": 64, "guided_json": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
            "required": ["name", "age"]}}
    if kind == "speculative":
        return "/v1/completions", {"prompt": "one two three one two three one two three one", "max_tokens": tokens,
                                   "temperature": 0}
    if kind == "bad":
        return "/v1/completions", rng.choice([{"prompt": ""}, {"prompt": "x", "temperature": -1},
                                              {"prompt": "x", "n": 1000}, {"messages": "nope"}])
    return "/v1/completions", {"prompt": f"Story number {rng.randint(0, 10**6)}:", "max_tokens": tokens,
                               "ignore_eos": True, "temperature": 0.8}


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally) -> None:
    path, body = _request(kind, rng)
    start = time.monotonic()
    try:
        if kind in ("stream", "abort"):
            leave_after = rng.randint(1, 4) if kind == "abort" else None
            async with client.stream("POST", path, json={**body, "stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if leave_after is not None and seen >= leave_after:
                        break
                status = str(r.status_code) if leave_after is None or seen < leave_after else "aborted"
        else:
            status = str((await client.post(path, json=body)).status_code)
    except httpx.HTTPError as e:
        status = f"transport:{type(e).__name__}"
        tally.errors.append(f"{kind}: {e!r}"[:300])
    tally.statuses[status] += 1
    tally.by_kind[f"{kind} {status}"] += 1
    if status == "200":
        tally.window_latencies.append(time.monotonic() - start)


async def _client_loop(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            await _one(client, rng.choice(KINDS), rng, tally)


async def _sampler(pid: int, url: str, start: float, deadline: float, interval: float, tally: Tally,
                   samples: list[Sample]) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            status = _proc_status(pid)
            latencies, tally.window_latencies = tally.window_latencies, []
            p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else None
            samples.append(Sample(
                t=round(time.monotonic() - start, 1), rss_mib=int(status["VmRSS"].split()[0]) / 1024,
                fds=len(os.listdir(f"/proc/{pid}/fd")), threads=int(status["Threads"]),
                kv_usage=_engine_gauges(client)["kv_cache_usage_perc"], p99_s=p99, requests=len(latencies),
            ))
            print(json.dumps(asdict(samples[-1])), flush=True)
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1200.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client loops")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="seconds left out of the slopes (the allocator's first growth is not a leak)")
    parser.add_argument("--max-rss-slope-mib-per-min", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out.with_suffix(".server.log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
                                   *SERVER_FLAGS], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}; see {log}")
            time.sleep(0.2)
        tally, samples = Tally(), []
        start = time.monotonic()
        deadline = start + args.duration

        async def run() -> None:
            await asyncio.gather(_sampler(server.pid, url, start, deadline, args.interval, tally, samples),
                                 *(_client_loop(url, seed, deadline, tally) for seed in range(args.clients)))

        asyncio.run(run())
        with httpx.Client(base_url=url, timeout=30) as client:
            settle = time.monotonic()
            while any(_engine_gauges(client).values()) and time.monotonic() - settle < 5:
                time.sleep(0.1)
            after = _engine_gauges(client)
    finally:
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(timeout=120)

    steady = [s for s in samples if s.t >= args.warmup] or samples
    slopes = {name: round(slope_per_minute([(s.t, getattr(s, name)) for s in steady]), 4)
              for name in ("rss_mib", "fds", "threads")}
    # The verdict reads the run's second half: a leak grows at its rate all the way
    # through, while the allocator's warm-up (new batch shapes, grammars, prefix hashes)
    # ends, and on a loaded machine it can outlast any fixed warm-up.
    judged_from = max(args.warmup, args.duration / 2)
    late = [s for s in samples if s.t >= judged_from] or samples
    late_rss_slope = round(slope_per_minute([(s.t, s.rss_mib) for s in late]), 4)
    server_errors = sum(n for status, n in tally.statuses.items() if status.startswith("5"))
    transport = sum(n for status, n in tally.statuses.items() if status.startswith("transport"))
    report = {
        "command": " ".join(sys.argv), "server_flags": list(SERVER_FLAGS), "duration_s": args.duration,
        "clients": args.clients, "statuses": dict(tally.statuses), "by_kind": dict(sorted(tally.by_kind.items())),
        "server_errors": server_errors, "transport_errors": transport, "errors": tally.errors[:20],
        "engine_after": after, "rss_mib_first_last": [samples[0].rss_mib, samples[-1].rss_mib],
        "slopes_per_min_after_warmup": slopes,
        "rss_slope_per_min_second_half": {"from_s": judged_from, "rss_mib": late_rss_slope},
        "server_exit_code": exit_code, "samples": [asdict(s) for s in samples],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    leaked = any(after.values())
    ok = not server_errors and not transport and not leaked and exit_code == 0 \
        and late_rss_slope <= args.max_rss_slope_mib_per_min
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
