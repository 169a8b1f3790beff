"""Where a stream's inter-token gaps go: a step timeline of one run (W1-shaped by default).

The real server (build_app + uvicorn, in this process) serves `pagedserve bench serve`
(a separate process, the same streaming client as every peer comparison). Inside the
server the engine's steps and Python's garbage collections are timestamped; the client's
token arrival times are moved onto the same clock (CLOCK_MONOTONIC is shared by
processes; the offset comes from the first request's send time and its arrival at the
engine). Each gap between two tokens of a stream is then split into

- step: the duration of the engine step that produced the later token;
- idle: time between the previous step's end and this step's start (the engine thread
  waking late, or waiting for work);
- delivery: from the step's end to the client reading the token (event loop, HTTP, client);
- gc: collections that ran inside the gap (in any of those parts).

so the tail can be read off: a long gap whose step was long is the machine (or the
model); one with idle or delivery time is the server; one with a collection is the GC.

    .venv/bin/python benchmarks/itl_timeline.py                      # W1: 8 x 128 in / 128 out
    .venv/bin/python benchmarks/itl_timeline.py --quantization gguf --out results/w1-timeline.json
    .venv/bin/python benchmarks/itl_timeline.py --num-prompts 48 --input-len 128 --range-ratio 0.5 \
        --output-len 64 --max-concurrency 16 --itl-target-ms 150        # the doctor's validation workload
"""
from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai.args import ServerConfig
from pagedserve.entrypoints.openai.server import build_app


@dataclass
class Trace:
    steps: list[tuple[float, float]] = field(default_factory=list)  # (start, end), perf_counter
    adds: list[float] = field(default_factory=list)
    collections: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, generation)
    _gc_start: float = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((self._gc_start, time.perf_counter(), info["generation"]))


def instrument(engine: LLMEngine, trace: Trace) -> None:
    step, add = engine.step, engine.add_request

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            trace.steps.append((start, time.perf_counter()))

    def timed_add(*args, **kwargs):
        trace.adds.append(time.perf_counter())
        return add(*args, **kwargs)

    engine.step, engine.add_request = timed_step, timed_add
    gc.callbacks.append(trace.on_gc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


def attribute(trace: Trace, token_times: list[list[float]], offset: float) -> list[dict]:
    """One entry per gap: its length and parts, in seconds."""
    ends = [e for _, e in trace.steps]
    gc_spans = [(s, e) for s, e, _ in trace.collections]
    gaps = []
    for times in token_times:
        times = [t + offset for t in times]
        for a, b in zip(times, times[1:]):
            # The step that produced the token read at b: the last one to end before it.
            i = max(j for j, e in enumerate(ends) if e <= b) if ends and ends[0] <= b else None
            if i is None:
                continue
            start, end = trace.steps[i]
            previous_end = ends[i - 1] if i else start
            gaps.append({"gap": b - a, "step": end - start, "idle": max(0.0, start - max(previous_end, a)),
                         "delivery": b - end, "gc": overlap(a, b, gc_spans)})
    return gaps


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(gaps: list[dict]) -> dict:
    lengths = [g["gap"] for g in gaps]
    p90 = percentile(lengths, 0.90)
    tail = [g for g in gaps if g["gap"] >= p90]
    ms = lambda x: round(1000 * x, 2)  # noqa: E731
    return {
        "gaps": len(gaps), "mean_ms": ms(statistics.fmean(lengths)), "p50_ms": ms(percentile(lengths, 0.5)),
        "p90_ms": ms(p90), "p99_ms": ms(percentile(lengths, 0.99)), "max_ms": ms(max(lengths)),
        "all_gaps_mean_parts_ms": {k: ms(statistics.fmean(g[k] for g in gaps)) for k in ("step", "idle", "delivery", "gc")},
        "tail_gaps": len(tail),
        "tail_mean_parts_ms": {k: ms(statistics.fmean(g[k] for g in tail)) for k in ("gap", "step", "idle", "delivery", "gc")},
        "tail_gaps_with_gc": sum(g["gc"] > 0 for g in tail),
        "tail_step_over_p90_of_steps": sum(g["step"] >= percentile([x["step"] for x in gaps], 0.9) for g in tail),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--itl-target-ms", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(quantization=args.quantization, itl_target_ms=args.itl_target_ms))
    trace = Trace()
    instrument(engine, trace)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ServerConfig(port=port)), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        client_start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", url,
                        "--dataset-name", "random", "--input-len", str(args.input_len), "--output-len",
                        str(args.output_len), "--range-ratio", str(args.range_ratio), "--max-concurrency",
                        str(args.max_concurrency), "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
                        "--vocab-size", "49152", "--ignore-eos", "--no-progress", "--out", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
        report = json.loads(out.read_text())
    server.should_exit = True
    thread.join(timeout=30)
    requests = report["requests"]
    # The client's clock starts just before its first send; the engine saw that request
    # arrive a few hundred microseconds later (HTTP, tokenisation): align the two there.
    first = min(requests, key=lambda r: r["send_time"])
    offset = trace.adds[0] - first["send_time"] if trace.adds else client_start
    gaps = attribute(trace, [r["chunk_times"] for r in requests], offset)
    summary = {"config": vars(args) | {"out": str(args.out) if args.out else None}, **summarize(gaps),
               "collections": {g: sum(1 for *_, gen in trace.collections if gen == g) for g in (0, 1, 2)},
               "gc_ms_total": round(1000 * sum(e - s for s, e, _ in trace.collections), 2)}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**summary, "gaps": gaps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
