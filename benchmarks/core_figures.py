"""Figures for pagedserve.core, measured with a stand-in runner (no model).

1. KV fragmentation waste of 16-token blocks on a production-like workload
   (1,000 requests, prompts 50-2,000 tokens, outputs 1,500 +- 600), at steady load,
   next to what contiguous per-request reservation would waste.
2. Scheduler overhead per step (schedule() + update()) with 128 decoding requests.
3. Prefix-cache hit rate when groups of requests share a 512-token system prompt.
4. Cost of hashing one full block for the prefix cache.

    .venv/bin/python benchmarks/core_figures.py [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import statistics
import struct
import time

from pagedserve.core import CacheConfig, Request, Scheduler, SchedulerConfig
from pagedserve.core.block_hash import ROOT_HASH, hash_block


def echo_runner(out) -> dict[str, list[int]]:
    """Samples token 1 for every row that wants samples: all the scheduler needs."""
    return {r.request_id: [1] * r.num_samples for r in out.scheduled if r.num_samples}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fragmentation(num_requests: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    block_size = 16
    max_num_seqs = 128
    # Sized so the pool, not max_num_seqs, is what binds at peak (about 2,500
    # tokens per sequence x 128 sequences > 2^18 slots): the load a server sees.
    num_blocks = 16_384
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs),
        CacheConfig(num_blocks=num_blocks, block_size=block_size),
    )
    lengths = []
    for i in range(num_requests):
        prompt = rng.randint(50, 2000)
        output = max(1, min(4000, round(rng.gauss(1500, 600))))
        lengths.append(prompt + output)
        sched.add_request(Request(f"r{i}", [rng.randrange(32_000) for _ in range(prompt)], output, ignore_eos=True))
    waste, usage, running = [], [], []
    steps = 0
    t0 = time.perf_counter()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, echo_runner(out))
        steps += 1
        stats = sched.stats()
        # Steady load: requests still queue behind a full batch or a full pool.
        if stats.num_waiting:
            waste.append(stats.kv_waste)
            usage.append(stats.kv_usage)
            running.append(stats.num_running)
    elapsed = time.perf_counter() - t0
    contiguous = 1 - statistics.fmean(lengths) / 8192
    print(f"1. fragmentation, {num_requests} requests, block 16, pool {num_blocks} blocks, {steps} steps ({elapsed:.1f} s)")
    print(f"   paged waste at steady load ({len(waste)} steps): mean {100 * statistics.fmean(waste):.2f}%  "
          f"p99 {100 * percentile(waste, 0.99):.2f}%  max {100 * max(waste):.2f}%")
    print(f"   kv usage mean {100 * statistics.fmean(usage):.1f}%, running mean {statistics.fmean(running):.0f}, "
          f"preemptions {sched.num_preemptions}")
    print(f"   contiguous reservation of 8,192 slots per request would waste {100 * contiguous:.1f}%")


def overhead(num_seqs: int = 128, steps: int = 2000) -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_seqs),
        CacheConfig(num_blocks=num_seqs * 200, block_size=16),
    )
    rng = random.Random(1)
    for i in range(num_seqs):
        prompt = [rng.randrange(32_000) for _ in range(rng.randint(50, 500))]
        sched.add_request(Request(f"r{i}", prompt, 3000, ignore_eos=True))
    for _ in range(20):  # prefill everyone and settle into decoding
        out = sched.schedule()
        sched.update(out, echo_runner(out))
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        out = sched.schedule()
        w1, c1 = time.perf_counter(), time.process_time()
        sampled = echo_runner(out)
        w2, c2 = time.perf_counter(), time.process_time()
        sched.update(out, sampled)
        w3, c3 = time.perf_counter(), time.process_time()
        assert len(out.scheduled) == num_seqs
        wall.append((w1 - w0 + w3 - w2) * 1e6)
        cpu.append((c1 - c0 + c3 - c2) * 1e6)
    # CPU time is what the scheduler costs; wall time also counts this process being
    # descheduled on a shared machine.
    print(f"2. scheduler overhead, {num_seqs} decoding requests, {steps} steps (schedule + update):")
    print(f"   CPU time mean {statistics.fmean(cpu):.0f} us  median {statistics.median(cpu):.0f} us  "
          f"p99 {percentile(cpu, 0.99):.0f} us per step; wall median {statistics.median(wall):.0f} us")


def prefix_hits(groups: int = 8, per_group: int = 32, system_len: int = 512, seed: int = 2) -> None:
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
                      CacheConfig(num_blocks=4096, block_size=16))
    systems = [[rng.randrange(32_000) for _ in range(system_len)] for _ in range(groups)]
    total_prompt = 0
    order = [(g, i) for g in range(groups) for i in range(per_group)]
    rng.shuffle(order)
    for g, i in order:
        prompt = systems[g] + [rng.randrange(32_000) for _ in range(rng.randint(32, 256))]
        total_prompt += len(prompt)
        sched.add_request(Request(f"g{g}-{i}", prompt, rng.randint(16, 64), ignore_eos=True))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, echo_runner(out))
    stats = sched.stats()
    shared_possible = (groups * per_group - groups) * system_len
    print(f"3. prefix cache, {groups} groups x {per_group} requests sharing a {system_len}-token system prompt:")
    print(f"   hit rate {100 * stats.prefix_cache_hit_rate:.1f}% of prompt tokens "
          f"({stats.prefix_cache_hits} of {stats.prefix_cache_queries}); the shared parts alone allow "
          f"{100 * shared_possible / total_prompt:.1f}%")


def hashing(block_size: int = 16, n: int = 100_000) -> None:
    tokens = list(range(1000, 1000 + block_size))
    t0 = time.perf_counter()
    for _ in range(n):
        hash_block(ROOT_HASH, tokens)
    ours = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        hashlib.sha256(pickle.dumps((ROOT_HASH, tuple(tokens), None))).digest()
    pickled = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    pack = struct.Struct(f"<{block_size}q").pack
    for _ in range(n):
        pack(*tokens)
    packing = (time.perf_counter() - t0) / n * 1e6
    print(f"4. block hash ({block_size} tokens): sha256 over struct-packed int64 {ours:.2f} us "
          f"(packing alone {packing:.2f} us); sha256 over pickle {pickled:.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 requests instead of 1,000 for figure 1")
    args = parser.parse_args()
    fragmentation(200 if args.quick else 1000)
    overhead()
    prefix_hits()
    hashing()


if __name__ == "__main__":
    main()
