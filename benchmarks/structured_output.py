"""What structured output costs: a decode step with 32 JSON-constrained rows against the
same step unconstrained, the mask time inside it, grammar compile times, and whether
filling masks on a thread during the forward would pay.

All figures come from one run, so read the ratios (the machine may be loaded):
  * step ratio: median step time, 32 rows all under a JSON schema / 32 free rows
    (same prompt, same context growth); the target is <= 1.15x;
  * mask time: time inside `constrain` (fill 32 bitmasks + mask the logits) and in
    advancing the matchers, per step, measured inside those real steps;
  * compile: building the backend's tokenizer once, a cold compile per new schema,
    a cache hit;
  * overlap: one free step with 32 mask fills running on a second thread vs the two
    one after the other (llguidance releases the GIL while it fills).

    .venv/bin/python benchmarks/structured_output.py [--seqs 32] [--steps 12] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

import pagedserve.worker.model_runner as model_runner
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.logits import GrammarStep, bitmask_words
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.structured_output.spec import StructuredOutputs

# minItems keeps every row inside the grammar for the whole measurement.
LIST_SCHEMA = {
    "type": "object", "required": ["items"], "additionalProperties": False,
    "properties": {"items": {"type": "array", "minItems": 60, "items": {
        "type": "object", "required": ["name", "qty"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 16}, "qty": {"type": "integer"}}}}},
}
COMPILE_SCHEMAS = [
    {"type": "object", "properties": {f"field_{i}": {"type": t} for i, t in
                                      enumerate(["string", "integer", "boolean", "number"][: k + 1])}}
    for k in range(4)
] + [
    {"type": "array", "items": {"type": "string", "pattern": "^[A-Z][a-z]{2,9}$"}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "b": {"type": "array", "items": {"enum": ["x", "y", "z"]}}}}]}}},
    LIST_SCHEMA,
]


class Timed:
    """Accumulates wall time spent in `fn`; `wrapper` is a plain function, so it also
    works as a method when set on a class."""

    def __init__(self, fn):
        self.elapsed = 0.0

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.elapsed += time.perf_counter() - t

        self.wrapper = wrapper


def start_batch(engine: LLMEngine, prompt: str, num_seqs: int, constrained: bool, max_tokens: int) -> list[str]:
    spec = StructuredOutputs(json=LIST_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=spec)
    ids = [engine.add_request(prompt, params) for _ in range(num_seqs)]
    # Prefill (one shared prompt, so the prefix cache serves all but the first) until all decode.
    while engine.scheduler.stats().num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return ids


def time_steps(engine: LLMEngine, steps: int, num_seqs: int, mask: Timed, accept: Timed) -> tuple[list[float], float]:
    times = []
    mask.elapsed = accept.elapsed = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        assert len(engine.scheduler.running) == num_seqs, "a row left the batch during the measurement"
    return times, (mask.elapsed + accept.elapsed) / steps


def fill_all(matchers, bitmask: torch.Tensor) -> None:
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(max_num_seqs=args.seqs, kv_cache_memory=512 << 20))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List sixty grocery items with quantities, as JSON."}])
    mask, accept = Timed(model_runner.constrain), Timed(GrammarStep.accept)
    model_runner.constrain, GrammarStep.accept = mask.wrapper, accept.wrapper
    max_tokens = args.steps + 8

    # Warm-up: first steps pay one-off allocation and the first grammar compile.
    ids = start_batch(engine, prompt, args.seqs, True, max_tokens)
    for rid in ids:
        engine.abort(rid)

    free_steps: list[float] = []
    json_steps: list[float] = []
    mask_per_step: list[float] = []
    snapshot = []
    for _ in range(args.rounds):
        for constrained in (False, True):
            ids = start_batch(engine, prompt, args.seqs, constrained, max_tokens)
            times, masked = time_steps(engine, args.steps, args.seqs, mask, accept)
            (json_steps if constrained else free_steps).extend(times)
            if constrained:
                mask_per_step.append(masked)
                snapshot = [r.sampling.matcher.fork() for r in engine.scheduler.running]
            for rid in ids:
                engine.abort(rid)

    free, constrained = statistics.median(free_steps), statistics.median(json_steps)
    masked = statistics.median(mask_per_step)
    print(f"decode step, {args.seqs} rows: free {free * 1e3:.1f} ms, JSON-constrained {constrained * 1e3:.1f} ms "
          f"-> ratio {constrained / free:.3f}x")
    print(f"  mask fill + apply + advance per constrained step: {masked * 1e3:.2f} ms "
          f"({masked / constrained:.1%} of the step)")

    # Fill alone, and fill on a thread while a free step runs.
    bitmask = torch.empty(len(snapshot), bitmask_words(engine.loaded.config.vocab_size), dtype=torch.int32)
    fills = []
    for _ in range(20):
        t = time.perf_counter()
        fill_all(snapshot, bitmask)
        fills.append(time.perf_counter() - t)
    fill = statistics.median(fills)
    ids = start_batch(engine, prompt, args.seqs, False, max_tokens)
    alone, together = [], []
    for _ in range(args.steps // 2):
        t = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - t)
        worker = threading.Thread(target=fill_all, args=(snapshot, bitmask))
        t = time.perf_counter()
        worker.start()
        engine.step()
        worker.join()
        together.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort(rid)
    step_alone, step_with_fill = statistics.median(alone), statistics.median(together)
    print(f"  fill of {len(snapshot)} masks alone: {fill * 1e3:.2f} ms; free step {step_alone * 1e3:.1f} ms; "
          f"step with the fill on a thread {step_with_fill * 1e3:.1f} ms "
          f"(saves {(step_alone + fill - step_with_fill) * 1e3:.2f} ms of {(step_alone + fill) * 1e3:.1f} ms)")

    # Compile times, on a fresh manager.
    manager = StructuredOutputManager(engine.tokenizer, engine.loaded.config.vocab_size)
    t = time.perf_counter()
    manager.compile(StructuredOutputs(json_object=True))  # builds the backend's tokenizer
    first = time.perf_counter() - t
    cold, cached = [], []
    for schema in COMPILE_SCHEMAS:
        spec = StructuredOutputs(json=json.dumps(schema))
        t = time.perf_counter()
        manager.compile(spec)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        manager.compile(StructuredOutputs(json=schema))
        cached.append(time.perf_counter() - t)
    print(f"compile: first (backend tokenizer + grammar) {first * 1e3:.0f} ms; cold schema median "
          f"{statistics.median(cold) * 1e3:.2f} ms, max {max(cold) * 1e3:.2f} ms; cached median "
          f"{statistics.median(cached) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
