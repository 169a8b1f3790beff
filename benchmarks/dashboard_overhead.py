"""What does an open /dashboard cost the engine? Paired batches, watched and not.

One AsyncEngine with the dashboard installed runs the same batch (greedy, fixed
output length, a fresh cache salt per batch so the prefix cache never helps) again
and again, alternately with nobody watching and with one page's stream open: the
real DashboardHub consumed like a browser's EventSource, so frames are built on the
engine thread and JSON-encoded on the loop as in the server. Order alternates within
each pair (off-on, on-off, ...) so drift from other load hits both arms alike. It
prints each pair's wall and process CPU seconds, the medians of the per-pair
overheads, and the time the engine thread itself spent on the dashboard (timed
around the feed's two methods) as a share of the watched steps' time.

With nobody watching, the engine thread reads one flag per step: that arm *is* the
no-dashboard baseline, up to that read.

    .venv/bin/python benchmarks/dashboard_overhead.py [--pairs 8] [--requests 16] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from fastapi import FastAPI

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.async_engine import AsyncEngine, GenerationRequest
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai.dashboard import DashboardHub, install_dashboard
from pagedserve.sampling_params import SamplingParams

PROMPT = "Write a detailed report on the history of paged virtual memory, request {}."


async def run_batch(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                    salt: str) -> tuple[float, float]:
    """Wall and process CPU seconds for one batch."""
    start, start_cpu = time.perf_counter(), time.process_time()
    streams = [engine.submit([GenerationRequest(f"{salt}-{i}", ids, params, time.monotonic(), cache_salt=salt)])
               for i, ids in enumerate(prompts)]
    for stream in streams:
        await stream.accepted()

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    await asyncio.gather(*(drain(s) for s in streams))
    return time.perf_counter() - start, time.process_time() - start_cpu


async def watch(hub: DashboardHub, step_ms: list[float]) -> None:
    """Consume the event stream as a page would, until cancelled; keep its step times."""
    async for event in hub.stream():
        if event.startswith("data: "):
            step_ms.extend(s["ms"] for s in json.loads(event[6:])["steps"])


def timed(obj: object, name: str, spent: list[float]) -> None:
    """Wrap obj.name so that every call adds its duration to spent[0]."""
    method = getattr(obj, name)

    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return method(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(obj, name, wrapper)


async def main_async(args: argparse.Namespace) -> None:
    llm = LLMEngine(EngineConfig(max_num_seqs=args.requests))
    engine = AsyncEngine(llm)
    hub = install_dashboard(FastAPI(), engine, "bench", show_prompts=False)
    # The engine thread's own dashboard work, timed directly: far less noisy than
    # the batch times on a loaded machine.
    feed_s = [0.0]
    timed(hub.feed, "record_step", feed_s)
    timed(hub.feed, "build_frame", feed_s)
    engine.start()
    prompts = [llm.tokenizer.encode(PROMPT.format(i)) for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    await run_batch(engine, prompts, params, "warm-up")
    wall, cpu, step_ms = [], [], []
    print(f"{args.requests} requests x {args.max_tokens} tokens per batch; wall (process CPU) seconds per batch")
    for pair in range(args.pairs):
        times = {}
        for watched in ((False, True) if pair % 2 == 0 else (True, False)):
            watcher = asyncio.create_task(watch(hub, step_ms)) if watched else None
            times[watched] = await run_batch(engine, prompts, params, f"p{pair}-{watched}")
            if watcher is not None:
                watcher.cancel()
                (outcome,) = await asyncio.gather(watcher, return_exceptions=True)
                if not isinstance(outcome, asyncio.CancelledError):
                    raise RuntimeError(f"the page's stream ended early: {outcome!r}")
        (off, off_cpu), (on, on_cpu) = times[False], times[True]
        wall.append(on / off - 1)
        cpu.append(on_cpu / off_cpu - 1)
        print(f"pair {pair}: unwatched {off:.3f} ({off_cpu:.3f})  watched {on:.3f} ({on_cpu:.3f})  "
              f"overhead {wall[-1]:+.2%} ({cpu[-1]:+.2%})")
    await engine.close()
    watched_s = sum(step_ms) / 1000
    for name, values in (("wall time", wall), ("process CPU time", cpu)):
        print(f"median overhead with a page open, {name}: {statistics.median(values):+.2%} "
              f"(min {min(values):+.2%}, max {max(values):+.2%})")
    print(f"mean step {statistics.fmean(step_ms):.1f} ms over {len(step_ms)} watched steps")
    print(f"engine-thread dashboard work while watched: {feed_s[0] * 1000:.1f} ms = "
          f"{feed_s[0] / watched_s:.3%} of the watched steps' time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
