"""How fast is one engine step, as a share of what this machine can do?

Measured in one run, so the ratios hold on a noisy machine:
  * the machine's fp32 matmul rate (2048^3 GEMM) and GEMV bandwidth;
  * decode: one step with N running sequences of ~C tokens of context, through the
    real scheduler, runner, paged attention and sampler;
  * the decode step's GEMMs alone at the same batch: the share of the matmul rate a
    step could reach with free attention and no overhead;
  * prefill: one 1,024-token prompt in a single step.
FLOPs counted: 2 x (non-embedding params) per token, plus 2 x vocab x hidden per
sampled row (the logits), plus attention (4 x layers x heads x head_dim x context
per query token). Overhead = step time minus time inside the model's forward.

    .venv/bin/python benchmarks/step_speed.py [--decode-seqs 32] [--context 256] [--kernels native,torch,native:gguf]

Paired before/after (--baseline-src OLD/src): the same workload in fresh subprocesses, one
importing pagedserve from OLD/src and one from this checkout's src, in turn for --rounds
rounds (the order alternating), so load from other processes reaches both alike. Each run
reports its median decode step, the part of it outside the model's forward (where the
engine's own per-step work shows) and one LLM.generate over the same prompts with n=2;
the summary is the median of the per-round new/old ratios.

    .venv/bin/python benchmarks/step_speed.py --baseline-src /tmp/base/src [--rounds 5] [--decode-seqs 32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.sim.twin import best_seconds, measure_matmul_flops

_SRC = Path(__file__).resolve().parents[1] / "src"


def gemv_gbps(rows: int = 8192, cols: int = 8192) -> float:
    """Decode-shaped bandwidth: one vector against a 256 MiB fp32 matrix."""
    w, x = torch.randn(rows, cols), torch.randn(cols)
    return w.numel() * 4 / best_seconds(lambda: w @ x, 10) / 1e9


def step_flops(engine: LLMEngine, tokens: int, contexts: list[int], sampled_rows: int) -> float:
    c = engine.loaded.config
    non_embedding = c.num_params - c.vocab_size * c.hidden_size
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * sum(contexts)
    return 2 * non_embedding * tokens + 2 * c.vocab_size * c.hidden_size * sampled_rows + attention


class ForwardTimer:
    """Wraps the model's forward to separate model time from step overhead."""

    def __init__(self, engine: LLMEngine):
        self.model = engine.runner.model
        self.inner = self.model.forward
        self.elapsed = 0.0
        self.model.forward = self

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.elapsed += time.perf_counter() - t
        return out


def start_decoding(engine: LLMEngine, num_seqs: int, context: int, max_tokens: int) -> None:
    """Add num_seqs distinct ~context-token prompts and step until all of them decode."""
    prompt = [(i * 7919) % 40000 + 100 for i in range(context)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        # Distinct prompts: no prefix-cache sharing inflates the rate.
        engine.add_request([(t + i) % 40000 + 100 for t in prompt], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def measure_decode(engines: list[LLMEngine], num_seqs: int, context: int, steps: int) -> list[dict]:
    """The median decode step of each engine, their steps taken in turn so that load
    from other processes reaches all of them alike."""
    for engine in engines:
        start_decoding(engine, num_seqs, context, steps + 2)
    timers = [ForwardTimer(engine) for engine in engines]
    samples: list[list[tuple[float, float, float]]] = [[] for _ in engines]
    for _ in range(steps):
        for engine, timer, taken in zip(engines, timers, samples):
            ctx = [r.num_tokens for r in engine.scheduler.running]
            before = timer.elapsed
            t = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t
            taken.append((seconds, timer.elapsed - before, step_flops(engine, len(ctx), ctx, len(ctx))))
    results = []
    for engine, timer, taken in zip(engines, timers, samples):
        engine.runner.model.forward = timer.inner
        while engine.has_unfinished_requests():
            engine.step()
        seconds, model_seconds, flops = sorted(taken)[len(taken) // 2]
        results.append({"step_s": seconds, "model_s": model_seconds, "gflops": flops / seconds / 1e9})
    return results


def linear_layers_seconds(engine: LLMEngine, rows: int) -> float:
    """The decode step's GEMMs alone (every layer's qkv, o, gate_up, down, and the head)
    at `rows` rows, best of 5: what a step would take with free attention and no overhead."""
    model = engine.runner.model
    x = {n: torch.randn(rows, n) for n in {model.config.hidden_size, model.config.intermediate_size,
                                           model.config.num_heads * model.config.head_dim}}
    modules = [*model.linear_layers(), model.lm_head]

    def run() -> None:
        for m in modules:
            m(x[m.in_features])

    with torch.inference_mode():
        return best_seconds(run, 5)


def prefill_step_seconds(engine: LLMEngine, length: int, r: int) -> float:
    """One step prefilling a fresh `length`-token prompt (the r-th distinct one), timed."""
    prompt = [(i * 31 + r * 977) % 40000 + 100 for i in range(length)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    t = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def measure_prefill(engine: LLMEngine, length: int, reps: int) -> dict:
    best = min(prefill_step_seconds(engine, length, r) for r in range(reps))
    return {"step_s": best, "gflops": step_flops(engine, length, [length // 2] * length, 1) / best / 1e9}


def paired_run(args: argparse.Namespace) -> dict:
    """One side of a paired comparison, in this process (whichever pagedserve it imports):
    the median decode step and its share outside the forward, then one LLM.generate."""
    from pagedserve import LLM

    llm = LLM(max_num_batched_tokens=max(args.prefill_len, args.decode_seqs * args.context), kv_cache_memory=1 << 30,
              enable_prefix_caching=False, kernels=args.kernels)
    engine = llm.engine
    start_decoding(engine, args.decode_seqs, args.context, args.steps + 2)
    timer = ForwardTimer(engine)
    taken = []
    for _ in range(args.steps):
        before, t = timer.elapsed, time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t
        taken.append((seconds, seconds - (timer.elapsed - before)))
    engine.runner.model.forward = timer.inner
    while engine.has_unfinished_requests():
        engine.step()
    prompts = [[(t * 7919 + i) % 40000 + 100 for t in range(args.context)] for i in range(args.decode_seqs)]
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=args.steps, ignore_eos=True)
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t
    assert all(len(c.token_ids) == args.steps for o in outputs for c in o.outputs)
    return {"step_s": statistics.median(s for s, _ in taken), "outside_s": statistics.median(o for _, o in taken),
            "generate_s": generate_s, "src": str(Path(sys.modules["pagedserve"].__file__).parents[1])}


def paired(args: argparse.Namespace) -> None:
    """Old (--baseline-src) and new (this checkout) in alternating subprocesses; new/old ratios."""
    sides = {"old": str(Path(args.baseline_src).resolve()), "new": str(_SRC)}
    worker = [sys.executable, __file__, "--paired-worker", "--decode-seqs", str(args.decode_seqs),
              "--context", str(args.context), "--steps", str(args.steps), "--prefill-len", str(args.prefill_len),
              "--kernels", args.kernels]
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            env = {**os.environ, "PYTHONPATH": sides[name]}
            done = subprocess.run(worker, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the {name} run failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if Path(result["src"]).resolve() != Path(sides[name]):
                raise RuntimeError(f"the {name} run imported pagedserve from {result['src']}, not {sides[name]}")
            runs[name].append(result)
            print(f"round {r} {name}: step {result['step_s'] * 1e3:.2f} ms (outside the forward "
                  f"{result['outside_s'] * 1e3:.2f} ms), generate {result['generate_s']:.2f} s", flush=True)
    for key in ("step_s", "outside_s", "generate_s"):
        ratios = [n[key] / o[key] for o, n in zip(runs["old"], runs["new"])]
        print(f"{key}: new/old median {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}x); "
              f"old median {statistics.median(o[key] for o in runs['old']):.4g} s, "
              f"new {statistics.median(n[key] for n in runs['new']):.4g} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--baseline-src", help="another checkout's src/: compare its engine step with this one's, "
                                           "paired (see above); --kernels takes one path then")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (with --baseline-src)")
    ap.add_argument("--paired-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", default="auto",
                    help="comma-separated kernel paths (auto, native, torch), each optionally with a "
                         "--quantization, a --kv-cache-dtype and --gguf-weights after colons (native:gguf, "
                         "native:none:fp16, native:none:auto:dense); "
                         "each its own engine, decode steps interleaved: e.g. native,torch,native:gguf for "
                         "paired ratios")
    args = ap.parse_args()
    if args.paired_worker:
        print(json.dumps(paired_run(args)))
        return
    if args.baseline_src:
        paired(args)
        return

    # Here, not at the top: a paired worker may import another checkout's pagedserve, where the
    # options module had another name.
    from pagedserve.engine_config import EngineConfig

    defaults = ["auto", "none", "auto", "blocks"]
    choices = [(parts := c.split(":")) + defaults[len(parts):] for c in args.kernels.split(",")]
    engines = [LLMEngine(EngineConfig(
        max_num_batched_tokens=max(args.prefill_len, args.decode_seqs * args.context),
        kv_cache_memory=1 << 30, enable_prefix_caching=False, kernels=kernels, quantization=quantization or "none",
        kv_cache_dtype=kv_dtype or "auto", gguf_weights=weights or "blocks",
    )) for kernels, quantization, kv_dtype, weights in choices]
    print(f"threads: {torch.get_num_threads()}")
    mm = measure_matmul_flops(2048, 2048, 2048) / 1e9
    bw = gemv_gbps()
    print(f"machine: fp32 matmul {mm:.1f} GFLOP/s (2048^3), GEMV {bw:.1f} GB/s")
    decodes = measure_decode(engines, args.decode_seqs, args.context, args.steps)
    for engine, d in zip(engines, decodes):
        overhead = 1 - d["model_s"] / d["step_s"]
        print(f"[{engine.kernels} kernels, {engine.runner.backend.name} attention, "
              f"{engine.config.load.quantization} weights ({engine.config.load.gguf_weights}), {engine.config.kv.kv_cache_dtype} KV] decode: {args.decode_seqs} seqs "
              f"x ~{args.context} ctx: step {d['step_s'] * 1e3:.1f} ms, {d['gflops']:.1f} GFLOP/s = "
              f"{d['gflops'] / mm:.0%} of matmul rate; overhead outside the forward {overhead:.1%}")
    if len(engines) > 1:
        print("decode step time relative to the first: "
              + ", ".join(f"{e.kernels}:{e.config.load.quantization}:{e.config.kv.kv_cache_dtype}:{e.config.load.gguf_weights} "
                        f"{d['step_s'] / decodes[0]['step_s']:.2f}x" for e, d in zip(engines, decodes)))
    engine, d = engines[0], decodes[0]
    gemm_s = linear_layers_seconds(engine, args.decode_seqs)
    print(f"ceiling: the step's GEMMs alone at {args.decode_seqs} rows take {gemm_s * 1e3:.1f} ms = "
          f"{d['gflops'] * d['step_s'] / gemm_s / mm:.0%} of matmul rate with free attention and no overhead")
    for engine in engines:
        p = measure_prefill(engine, args.prefill_len, 3)
        print(f"[{engine.kernels} kernels, {engine.config.load.quantization} weights] prefill: {args.prefill_len} tokens in one step: "
              f"{p['step_s'] * 1e3:.0f} ms, {p['gflops']:.1f} GFLOP/s = {p['gflops'] / mm:.0%} of matmul rate")


if __name__ == "__main__":
    main()
