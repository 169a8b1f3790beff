"""Does stepping the engine from a non-main thread cost time? It did (docs/notebook/2026-rounds.md,
fifth round) until AsyncEngine freed the main thread's OpenMP pool before starting its
thread (engine/openmp_pool.py; sixth round). A served engine pays whatever this measures.

Two parts, each alternating three arms so that drift reaches them alike: the process's
main thread, a fresh thread beside the main thread's OpenMP pool ("thread"), and a fresh
thread after release_thread_pool() on the main thread ("released", what AsyncEngine does):

  * ops: per-call time of an op that opens an OpenMP parallel region (the native rms_norm
    over 72 rows), one that runs inline (the same over 1 row) and a 256-row linear layer;
  * workload (--workload): a W4-shaped run through LLMEngine.step() in a loop (96 requests,
    every 8th prompt 2,000 tokens else 64, 64 out, at most 32 in flight), its total time.

    .venv/bin/python benchmarks/engine_thread.py [--rounds 3] [--workload]
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.openmp_pool import release_thread_pool
from pagedserve.kernels import resolve_kernels
from pagedserve.model.config import QTYPES
from pagedserve.model.quant import QuantLinear
from pagedserve.sampling_params import SamplingParams


def on_thread(fn: Callable[[], object], release: bool = False) -> object:
    if release:
        release_thread_pool()
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def median_call_us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def op_times() -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    weight = torch.ones(64)
    region, inline = torch.randn(8, 9, 64, generator=g), torch.randn(1, 64, generator=g)
    linear = QuantLinear.from_float(torch.randn(3072, 576, generator=g) * 0.05, QTYPES["q4_1"])
    x = torch.randn(256, 576, generator=g)
    return {
        "rms_norm 72 rows (a region) us": median_call_us(lambda: torch.ops.pagedserve.rms_norm(region, weight, 1e-5), 400),
        "rms_norm 1 row (inline) us": median_call_us(lambda: torch.ops.pagedserve.rms_norm(inline, weight, 1e-5), 400),
        "linear 256 x 576 -> 3072 us": median_call_us(lambda: linear(x), 40),
    }


def workload_seconds(engine: LLMEngine, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(2000 if i % 8 == 0 else 64)] for i in range(96)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    pending, live = list(reversed(prompts)), 0
    while pending or engine.has_unfinished_requests():
        while pending and live < 32:
            engine.add_request(pending.pop(), params)
            live += 1
        live -= sum(out.finished for out in engine.step())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", action="store_true", help="also time the W4-shaped engine run")
    args = parser.parse_args()
    resolve_kernels("native")
    for round_ in range(args.rounds):
        arms = {"main": op_times(), "thread": on_thread(op_times), "released": on_thread(op_times, release=True)}
        print(f"round {round_}: " + "; ".join(
            f"{k} " + " ".join(f"{arm} {ops[k]:.1f}" for arm, ops in arms.items()) for k in arms["main"]))
    if args.workload:
        # Prefix caching off and fresh prompts per run: no run is served from another's cache.
        engine = LLMEngine(EngineConfig(enable_prefix_caching=False))
        for round_ in range(args.rounds):
            main_s = workload_seconds(engine, 3 * round_)
            thread_s = on_thread(lambda: workload_seconds(engine, 3 * round_ + 1))
            released_s = on_thread(lambda: workload_seconds(engine, 3 * round_ + 2), release=True)
            print(f"W4-shaped run, round {round_}: main {main_s:.1f} s, thread {thread_s:.1f} s "
                  f"({thread_s / main_s:.2f}x), released {released_s:.1f} s ({released_s / main_s:.2f}x)")


if __name__ == "__main__":
    main()
