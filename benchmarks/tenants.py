"""Two-tenant fairness (docs/tenants.md): tenant A floods, tenant B sends at a light rate; B's
TTFT with no tenant rules (fcfs, no budgets) against A under a budget and a lower priority
class (--scheduling-policy priority), each beside B alone on an idle server.

Starts its own `pagedserve serve` per setup (tests/server/server_process.py) with a keys file
it writes, so the same engine flags run every setup.

    .venv/bin/python benchmarks/tenants.py                     # the docs' run
    .venv/bin/python benchmarks/tenants.py --duration 8 --flood-rate 4 --light-rate 1 --max-tokens 8  # tiny
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server.server_process import start_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from pagedserve.workload.serving_stats import percentile  # noqa: E402

KEY_A, KEY_B = "sk-bench-flood-a", "sk-bench-light-b"
# docs/tenants.md's bound: with A budgeted in a lower class, B's p99 TTFT beside the flood is
# within this factor of its p99 alone.
BOUND = 2.0
# The setups: (name, server flags beyond the engine's, tenant A's settings).
SETUPS = {
    "fcfs, no budgets": ((), "{{}}"),
    "priority, A budgeted": (("--scheduling-policy", "priority"), "{{priority: 10, max_concurrency: {cap}}}"),
}


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    refused: int = 0
    errors: list[str] = field(default_factory=list)


async def one_request(session: aiohttp.ClientSession, url: str, key: str, body: dict, tally: Tally) -> None:
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as resp:
            if resp.status == 429:
                tally.refused += 1
                return
            if resp.status != 200:
                tally.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            async for line in resp.content:
                if line.startswith(b"data:") and b'"text"' in line:
                    tally.ttfts.append(time.perf_counter() - start)
                    break
            async for _ in resp.content:  # the rest of the stream
                pass
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        tally.errors.append(f"{type(e).__name__}: {e}")


async def poisson(session, url: str, key: str, body: dict, rate: float, duration: float, seed: int) -> Tally:
    """Requests at Poisson times for `duration` seconds, each streamed to its end."""
    rng, tally, tasks = random.Random(seed), Tally(), []
    t = rng.expovariate(rate)
    start = time.perf_counter()
    while t < duration:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one_request(session, url, key, body, tally)))
        t += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return tally


async def run_load(base: str, args: argparse.Namespace, flood: bool) -> dict:
    url = base + "/v1/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async with session.get(base + "/v1/models", headers={"authorization": f"Bearer {KEY_B}"}) as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
        light_body = {**body, "prompt": "Tell me about the sea."}
        flood_body = {**body, "prompt": "Write a long story about a ship. " * 8}
        light = poisson(session, url, KEY_B, light_body, args.light_rate, args.duration, seed=1)
        if not flood:
            return summary(await light, None)
        b, a = await asyncio.gather(light, poisson(session, url, KEY_A, flood_body, args.flood_rate, args.duration, 2))
        return summary(b, a)


def summary(b: Tally, a: Tally | None) -> dict:
    ms = [x * 1e3 for x in b.ttfts]
    out = {"b_requests": len(ms), "b_p50_ttft_ms": round(statistics.median(ms), 1) if ms else None,
           "b_p99_ttft_ms": round(percentile(ms, 99), 1) if ms else None, "b_refused": b.refused,
           "errors": (b.errors + (a.errors if a else []))[:5]}
    if a is not None:
        out.update(a_served=len(a.ttfts), a_refused=a.refused)
    return out


def run_setup(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    flags, a_settings = SETUPS[name]
    keys = workdir / "keys.yaml"
    keys.write_text(f"tenants:\n  a: {a_settings.format(cap=args.flood_cap)}\n  b: {{priority: 0}}\n"
                    f"keys:\n  - {{tenant: a, key: {KEY_A}}}\n  - {{tenant: b, key: {KEY_B}}}\n")
    server = start_server(workdir, "--api-keys", str(keys), "--max-num-seqs", str(args.max_num_seqs), *flags)
    try:
        alone = asyncio.run(run_load(server.url, args, flood=False))
        shared = asyncio.run(run_load(server.url, args, flood=True))
    finally:
        server.stop()
    return {"setup": name, "b_alone": alone, "with_flood": shared}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds each load runs")
    p.add_argument("--flood-rate", type=float, default=16.0, help="tenant A's requests a second")
    p.add_argument("--light-rate", type=float, default=0.5, help="tenant B's requests a second")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--flood-cap", type=int, default=4, help="tenant A's max_concurrency when budgeted")
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_setup(name, args, Path(tmp)) for name in SETUPS]
    for r in results:
        alone, shared = r["b_alone"], r["with_flood"]
        if alone["b_p99_ttft_ms"] and shared["b_p99_ttft_ms"]:
            r["b_p99_ratio"] = round(shared["b_p99_ttft_ms"] / alone["b_p99_ttft_ms"], 2)
        print(f"{r['setup']:<22} B alone p99 TTFT {alone['b_p99_ttft_ms']} ms; with A flooding: B p50 "
              f"{shared['b_p50_ttft_ms']} ms, p99 {shared['b_p99_ttft_ms']} ms ({shared['b_requests']} requests), "
              f"{r.get('b_p99_ratio')}x alone (bound {BOUND}x with A budgeted); A served {shared['a_served']}, "
              f"refused {shared['a_refused']}; errors {shared['errors']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
