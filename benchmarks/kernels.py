"""pagedserve's native ops against today's torch path, paired in one process.

    .venv/bin/python benchmarks/kernels.py [--section attention|decode-paths|half-linear] [--reps 15]
        [--threads 2] [--clock wall|cpu] [--half-shapes 2048x2048,8192x2048]

Each section times its native op and the torch path it replaces on the same inputs,
interleaved call by call so that load from other processes hits both alike, and
prints medians and their ratio (torch / native: above 1 means native is faster).
On a shared machine `--threads 1 --clock cpu` (this thread's CPU time) gives the
steadiest ratios.

attention: one layer's attention (decodes, verification rows, prefill chunks) on SmolLM2-135M shapes (9 query heads, 3 KV heads,
head_dim 64, block 16, fp32, shuffled block tables): NativePagedAttention.forward
against CpuPagedAttention.forward, both with the step's plan already built (the
runner builds it once for all 30 layers) and both writing the step's K/V. Also the
K/V bytes the native op reads per second against the machine's copy bandwidth
(bytes read + written per second copying a 256 MiB tensor).

decode-paths: the native decode op alone at W3's shape (64 decodes x 320 keys) over 30
layers' caches, so that K/V come from memory as in the engine, for each cache dtype
(fp32, fp16) and each instruction-set path (the widest the CPU has, and AVX2 through
PAGEDSERVE_NATIVE_ISA), interleaved layer pass by layer pass; milliseconds per layer.

half-linear: one linear layer (--half-shapes, N x K: 2048x2048 is a 1B model's q/o, 8192x2048
its gate/up) at 1 and 16 rows, its weights as fp32 (oneDNN, prepacked: the path a checkpoint
inflated to fp32 takes) and as stored in BF16 and F16 (dequant_linear's tiles, fp32
arithmetic: the same model), interleaved; milliseconds per call, GB/s of weight bytes read,
and fp32's time over each. Several copies of each weight, used in turn, keep them out of
the caches as a model's layers are.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve.attention import cpu_backend
from pagedserve.attention.backend import ReferenceBackend, to_cache_dtype
from pagedserve.attention.cpu_backend import CpuPagedAttention
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.attention.testing import random_step
from pagedserve.kernels import native_isa, native_unavailable_reason
from pagedserve.model.llama import Linear
from pagedserve.model.quant import BF16, F16, QuantLinear, half_blocks

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
KV_BYTES_PER_TOKEN = 2 * NUM_KV_HEADS * HEAD_DIM * 4


def paired(fns: list[Callable[[], object]], reps: int, clock: Callable[[], float]) -> list[float]:
    """Median seconds of each function, called in turn rep after rep."""
    for fn in fns:
        fn()  # warm-up: first-touch page faults, workspaces, plans
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t = clock()
            fn()
            ts.append(clock() - t)
    return [statistics.median(ts) for ts in times]


def copy_bandwidth(reps: int, clock: Callable[[], float]) -> float:
    """Bytes read + written per second copying a 256 MiB float32 tensor."""
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    (seconds,) = paired([lambda: dst.copy_(src)], reps, clock)
    return 2 * src.numel() * 4 / seconds


def attention_cases() -> dict[str, list[tuple[int, int]]]:
    """(query_len, seq_len) per sequence, for each named step."""
    rnd = random.Random(0)
    return {
        "decode 32x512": [(1, 512)] * 32,
        "decode 32x1024": [(1, 1024)] * 32,
        "decode 32x2048": [(1, 2048)] * 32,
        "decode 32xU[512,2048]": [(1, rnd.randint(512, 2048)) for _ in range(32)],
        "decode 64x256": [(1, 256)] * 64,
        "decode 1x2048": [(1, 2048)],
        "decode 1x8192": [(1, 8192)],
        "decode 4x4096": [(1, 4096)] * 4,
        "spec 16x(2..5) U[64,2048]": [(rnd.randint(2, 5), rnd.randint(64, 2048)) for _ in range(16)],
        "mixed 32 decodes + 256 after 1000": [(1, rnd.randint(64, 2048)) for _ in range(32)] + [(256, 1256)],
        # Prefill chunks alone: since 2026-12-03 the native op takes them too (batch-invariant
        # bits); the torch path is flash attention over the chunk plus the gathered context.
        "prefill 256 from 0": [(256, 256)],
        "prefill 256 after 1000": [(256, 1256)],
        "prefill 512 after 1536": [(512, 2048)],
        "prefill 2048 from 0": [(2048, 2048)],
        "prefill 4x128 from 0": [(128, 128)] * 4,
    }


def attention_section(reps: int, clock: Callable[[], float]) -> None:
    bandwidth = copy_bandwidth(reps, clock)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + written)")
    print(f"{'case':36} {'torch ms':>9} {'native ms':>9} {'ratio':>6} {'KV GB/s':>8} {'of copy':>7}")
    for name, seqs in attention_cases().items():
        q, k, v, cache, meta = random_step(seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, spare_blocks=1)
        expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, SCALE) if len(seqs) <= 4 else None
        torch_backend, native = CpuPagedAttention(), NativePagedAttention()
        torch_backend.prepare(meta)
        native.prepare(meta)
        if expected is not None:
            torch.testing.assert_close(native.forward(q, k, v, cache, meta, SCALE), expected, rtol=1e-4, atol=1e-5)
        t_torch, t_native = paired(
            [lambda: torch_backend.forward(q, k, v, cache, meta, SCALE), lambda: native.forward(q, k, v, cache, meta, SCALE)],
            reps, clock,
        )
        row = f"{name:36} {t_torch * 1e3:9.2f} {t_native * 1e3:9.2f} {t_torch / t_native:5.2f}x"
        if all(n < cpu_backend.PREFILL_MIN_QUERY_LEN for n, _ in seqs):  # all of it the native op's work
            rate = KV_BYTES_PER_TOKEN * sum(s for _, s in seqs) / t_native
            row += f" {rate / 1e9:8.1f} {rate / bandwidth:7.0%}"
        print(row)


def decode_paths_section(reps: int, clock: Callable[[], float], layers: int = 30) -> None:
    seqs = [(1, 320)] * 64
    q, _, _, cache, meta = random_step(seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, spare_blocks=1)
    out = torch.empty(q.shape[0], NUM_HEADS * HEAD_DIM)
    ids = torch.arange(len(seqs))
    caches = {name: [to_cache_dtype(cache, dtype).clone() for _ in range(layers)]
              for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16))}
    wide = native_isa()
    arms = [(name, isa) for name in caches for isa in dict.fromkeys((wide, "avx2"))]

    def pass_over_layers(name: str, isa: str) -> Callable[[], None]:
        def run() -> None:
            os.environ["PAGEDSERVE_NATIVE_ISA"] = "avx2" if isa == "avx2" else "auto"
            for layer_cache in caches[name]:
                torch.ops.pagedserve.paged_attention_(out, q, layer_cache, meta.block_tables, meta.query_start_loc,
                                                      meta.seq_lens, ids, SCALE)
        return run

    before = os.environ.get("PAGEDSERVE_NATIVE_ISA")
    try:
        times = paired([pass_over_layers(name, isa) for name, isa in arms], reps, clock)
    finally:
        if before is None:
            os.environ.pop("PAGEDSERVE_NATIVE_ISA", None)
        else:
            os.environ["PAGEDSERVE_NATIVE_ISA"] = before
    base = times[arms.index(("fp32", "avx2"))]
    print(f"64 decodes x 320 keys, {layers} layers' caches")
    print(f"{'cache':6} {'path':12} {'ms/layer':>9} {'vs fp32 avx2':>13}")
    for (name, isa), t in zip(arms, times):
        print(f"{name:6} {isa:12} {t / layers * 1e3:9.3f} {base / t:12.2f}x")


HALF_SHAPES = [(2048, 2048), (8192, 2048)]
HALF_COPIES_BYTES = 256 << 20  # fp32 bytes of each arm's copies: well past any L3


def half_linear_layers(n: int, k: int) -> dict[str, list[torch.nn.Module]]:
    """Each arm's copies of one random N x K layer (fp32 prepacked, BF16 and F16 as stored)."""
    copies = min(64, max(1, HALF_COPIES_BYTES // (n * k * 4)))
    arms: dict[str, list[torch.nn.Module]] = {"fp32": [], "bf16": [], "f16": []}
    for _ in range(copies):
        w = torch.randn(n, k) * k**-0.5
        fp32 = Linear(k, n, bias=False).requires_grad_(False)
        fp32.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        fp32.pack()
        arms["fp32"].append(fp32)
        arms["bf16"].append(QuantLinear(half_blocks(w.to(torch.bfloat16)), BF16, activations="fp32"))
        arms["f16"].append(QuantLinear(half_blocks(w.to(torch.float16)), F16, activations="fp32"))
    return arms


def half_linear_section(reps: int, clock: Callable[[], float], shapes: list[tuple[int, int]] | None = None) -> None:
    print(f"{'N x K':>11} {'rows':>4} {'arm':>5} {'ms':>8} {'GB/s':>7} {'fp32 / arm':>10}")
    for n, k in shapes or HALF_SHAPES:
        arms = half_linear_layers(n, k)
        for rows in (1, 16):
            x = torch.randn(rows, k)

            def call(layers: list[torch.nn.Module]) -> Callable[[], None]:
                turn = itertools.cycle(layers)
                return lambda: next(turn)(x)

            times = paired([call(layers) for layers in arms.values()], reps * len(arms["fp32"]), clock)
            for (name, _), t in zip(arms.items(), times):
                weight_bytes = n * k * (4 if name == "fp32" else 2)
                print(f"{n:>5}x{k:<5} {rows:>4} {name:>5} {t * 1e3:8.3f} {weight_bytes / t / 1e9:7.1f} "
                      f"{times[0] / t:9.2f}x")


SECTIONS: dict[str, Callable[[int, Callable[[], float]], None]] = {
    "attention": attention_section, "decode-paths": decode_paths_section, "half-linear": half_linear_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=sorted(SECTIONS), action="append",
                    help="run only these sections (repeatable); default: all")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (steady under load, meaningful with --threads 1)")
    ap.add_argument("--half-shapes", default=None, help="half-linear's N x K shapes, e.g. 2048x2048,8192x2048")
    args = ap.parse_args()
    if args.half_shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.half_shapes.split(",")]
        SECTIONS["half-linear"] = lambda reps, clock: half_linear_section(reps, clock, shapes)
    reason = native_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the native library cannot run: {reason}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"threads: {args.threads}, clock: {args.clock}, reps: {args.reps}")
    with torch.inference_mode():
        for name in args.section or sorted(SECTIONS):
            print(f"== {name}")
            SECTIONS[name](args.reps, clock)


if __name__ == "__main__":
    main()
