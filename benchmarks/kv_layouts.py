"""The contiguous KV layout (vAttention on a CPU) against the paged one, paired and interleaved.

    PYTHONPATH=src .venv/bin/python benchmarks/kv_layouts.py [--part attention,engine] [--reps 7]
        [--threads 1] [--clock cpu|wall] [--scale 1.0] [--out benchmarks/results/kv_layouts.json]

Part "attention": one layer's forward (write_kv included) per step shape, ms, the best of
--reps calls with the candidates interleaved call by call (`--clock cpu`: this thread's
CPU time, which with --threads 1 stays meaningful on a machine shared with other jobs,
where wall-clock figures of small calls swing by 10x and more): the paged cache with shuffled
block tables (as a pool looks after churn) under the native op and the torch gather
backend, and the contiguous layout (each sequence's blocks consecutive) under its native
path (the same op over consecutive tables) and its torch path (per-sequence views, no
gather). Multiply by 30 for a SmolLM2 step.

Part "sharing": what prefix sharing would cost the contiguous layout. A memfd holds the
shared K/V; a 1,008-token prefix hit is mapped (mmap MAP_FIXED) into the 60 streams of a
region either block by block (each 16-token block is 3 pages of a stream for SmolLM2),
at file offsets in reverse order, as scattered cached blocks would be, or as one run per
stream (the prefix as its first request wrote it): the time and the VMAs one hit leaves.

Part "engine": the real engine over the same loaded weights on small versions of the
study workload and of W1/W2 (`--scale` multiplies prompt counts and output lengths),
paged and contiguous alternating run by run (paged, contiguous, paged, contiguous), greedy,
ignore_eos: throughput, p99 ITL, KV waste, and the KV memory committed: the paged pool is
zero-filled at start, so all of --kv-cache-memory; the contiguous layout's peak committed
pages (from its accounting, which tests/test_kv_layouts.py checks against the OS).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pagedserve.attention.contiguous_backend import ContiguousAttention, NativeContiguousAttention
from pagedserve.attention.cpu_backend import CpuPagedAttention
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.attention.testing import contiguous_step, random_step

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
KV_MEMORY = 256 << 20


def attention_cases() -> dict[str, list[tuple[int, int]]]:
    rnd = random.Random(0)
    return {
        "decode 1x2048": [(1, 2048)],
        "decode 16x512": [(1, 512)] * 16,
        "decode 32xU[64,2048]": [(1, rnd.randint(64, 2048)) for _ in range(32)],
        "decode 64x512": [(1, 512)] * 64,
        "spec 16x4 U[64,1024]": [(4, rnd.randint(64, 1024)) for _ in range(16)],
        "prefill 256 after 1000": [(256, 1256)],
    }


def time_attention(reps: int, clock) -> list[dict]:
    rows = []
    for name, seqs in attention_cases().items():
        paged = random_step(seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK)
        contiguous = contiguous_step(seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, region_tokens=2048)
        candidates = {
            "paged native": (NativePagedAttention(), paged),
            "contiguous native": (NativeContiguousAttention(), contiguous),
            "paged torch (gather)": (CpuPagedAttention(), paged),
            "contiguous torch (views)": (ContiguousAttention(), contiguous),
        }
        best = {c: float("inf") for c in candidates}
        with torch.inference_mode():
            for b, (q, k, v, cache, meta) in candidates.values():
                b.prepare(meta)
                b.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)  # warm: plans, workspaces
            for _ in range(reps):
                for c, (b, (q, k, v, cache, meta)) in candidates.items():
                    t0 = clock()
                    b.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)
                    best[c] = min(best[c], clock() - t0)
        row = {"case": name, **{c: round(s * 1e3, 3) for c, s in best.items()}}
        row["contiguous/paged native"] = round(best["contiguous native"] / best["paged native"], 2)
        row["contiguous/paged torch"] = round(best["contiguous torch (views)"] / best["paged torch (gather)"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def time_sharing(prefix_tokens: int = 1008) -> list[dict]:
    return [_map_prefix(prefix_tokens, per_block=True), _map_prefix(prefix_tokens, per_block=False)]


def _map_prefix(prefix_tokens: int, per_block: bool) -> dict:
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    streams, stream_bytes, page = 60, 768, mmap.PAGESIZE
    block_bytes = BLOCK * stream_bytes  # 3 pages
    blocks = prefix_tokens // BLOCK
    fd = os.memfd_create("kv-prefix")
    os.ftruncate(fd, streams * blocks * block_bytes)
    region_bytes = 8192 * stream_bytes
    region = mmap.mmap(-1, streams * region_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    with open("/proc/self/maps") as f:
        before = sum(1 for _ in f)
    t0 = time.perf_counter()
    pieces = [(b, blocks - 1 - b, 1) for b in range(blocks)] if per_block else [(0, 0, blocks)]
    for st in range(streams):
        for at, src, count in pieces:
            addr = base + st * region_bytes + at * block_bytes
            offset = (st * blocks + src) * block_bytes
            if libc.mmap(addr, count * block_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10, fd,
                         offset) != addr:
                raise OSError(ctypes.get_errno(), "mmap(MAP_FIXED) failed")
    seconds = time.perf_counter() - t0
    with open("/proc/self/maps") as f:
        after = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
        max_maps = int(f.read())
    os.close(fd)
    remaps = streams * len(pieces)
    row = {"mapped": "per block" if per_block else "one run per stream", "prefix_tokens": blocks * BLOCK,
           "remaps": remaps, "seconds": round(seconds, 4), "us_per_remap": round(seconds / remaps * 1e6, 1),
           "new_vmas": after - before,
           "max_map_count": max_maps}
    print(row, flush=True)
    return row


def engine_workloads(scale: float):
    from pagedserve.workload.datasets import mixed_dataset, random_dataset

    def n(x: int) -> int:
        return max(1, round(x * scale))

    return {
        "W1-small": (random_dataset(n(2), 128, n(32), range_ratio=0, seed=1), 1),
        "W2-small": (random_dataset(n(16), 128, n(32), range_ratio=0, seed=2), 16),
        # the study's shape (prompts 40-255, outputs 68-255 in the full run), all at once
        "study-small": (random_dataset(n(16), 144, n(64), range_ratio=0.777, output_range_ratio=0.6, seed=0), None),
        "W3-small": (random_dataset(n(48), 256, n(32), range_ratio=0, seed=3), 32),
        # every 8th prompt 2,000 tokens, the rest 64
        "W4-small": (mixed_dataset(n(24), 64, 2000, 8, n(32), 0.0, seed=4), 16),
    }


def run_engines(scale: float, repeats: int) -> list[dict]:
    from pagedserve.bench.compare import run_engine
    from pagedserve.model.loader import load_model

    loaded = load_model()
    rows = []
    for wname, (requests, concurrency) in engine_workloads(scale).items():
        per_layout: dict[str, list[dict]] = {"paged": [], "contiguous": []}
        for _ in range(repeats):
            for layout in ("paged", "contiguous"):
                # Prefix caching off in both: the contiguous layout has none, and these
                # random prompts share no prefix anyway.
                res = run_engine(loaded, "chunked", requests, max_concurrency=concurrency, kv_layout=layout,
                                 kv_cache_memory=KV_MEMORY, enable_prefix_caching=False, max_num_seqs=32)
                s = res.summary()
                row = {"workload": wname, "layout": layout,
                       **{k: s[k] for k in ("output_throughput", "p99_itl_ms", "mean_itl_ms", "kv_waste",
                                            "peak_kv_committed_mib", "num_preemptions")},
                       # Block-equivalents in use at the peak (16-token blocks of 46,080 B/token).
                       "peak_used_mib": s["peak_blocks_used"] * BLOCK * 46080 / 2**20}
                per_layout[layout].append(row)
                print(json.dumps(row), flush=True)
        for layout, runs in per_layout.items():
            rows.append({"workload": wname, "layout": layout, "runs": len(runs),
                         **{k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("workload", "layout")}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="attention,sharing,engine")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--repeats", type=int, default=2, help="engine runs per layout and workload")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("cpu", "wall"), default="wall")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.part.split(",")
    result = {"threads": torch.get_num_threads(), "clock": args.clock, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if "attention" in parts:
        result["attention_ms_per_layer"] = time_attention(
            args.reps, time.thread_time if args.clock == "cpu" else time.perf_counter)
    if "sharing" in parts:
        result["sharing"] = time_sharing()
    if "engine" in parts:
        result["engine"] = run_engines(args.scale, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
