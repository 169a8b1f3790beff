"""What structured output costs: a decode step with 32 JSON-constrained rows against the
same step unconstrained, the mask time inside it, grammar compile times, and whether
filling masks on a thread during the forward would pay.

All figures come from one run, so read the ratios (the machine may be loaded):
  * step ratio: two engines over the same weights, one with 32 rows all under a JSON
    schema and one with 32 free rows (same prompt, same context growth), stepped
    alternately so load bursts hit both alike; median of the paired ratios (target
    <= 1.15x);
  * mask time: time inside `constrain` (fill 32 bitmasks + mask the logits) and in
    advancing the matchers, per step, measured inside those real steps;
  * compile: building the backend's tokenizer once, a cold compile per new schema,
    a cache hit;
  * overlap: filling masks on a thread while the forward runs (llguidance releases
    the GIL) can save at most the fill time, so that is what is measured.

    .venv/bin/python benchmarks/structured_output.py [--seqs 32] [--steps 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import pagedserve.worker.model_runner as model_runner
from pagedserve.engine_config import EngineConfig
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


def fill_all(matchers, bitmask: torch.Tensor) -> None:
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()

    config = EngineConfig(max_num_seqs=args.seqs, kv_cache_memory=128 << 20)
    free_engine = LLMEngine(config)
    json_engine = LLMEngine(config, loaded=free_engine.loaded)
    prompt = free_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List sixty grocery items with quantities, as JSON."}])
    mask, accept = Timed(model_runner.constrain), Timed(GrammarStep.accept)
    model_runner.constrain, GrammarStep.accept = mask.wrapper, accept.wrapper
    max_tokens = args.steps + 8

    start_batch(free_engine, prompt, args.seqs, False, max_tokens)
    start_batch(json_engine, prompt, args.seqs, True, max_tokens)
    for engine in (free_engine, json_engine):  # one-off allocations out of the way
        engine.step()
    free_steps, json_steps, mask_steps = [], [], []
    for i in range(args.steps):
        for engine in ((free_engine, json_engine) if i % 2 else (json_engine, free_engine)):
            mask.elapsed = accept.elapsed = 0.0
            t = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t
            assert len(engine.scheduler.running) == args.seqs, "a row left the batch during the measurement"
            if engine is json_engine:
                json_steps.append(elapsed)
                mask_steps.append(mask.elapsed + accept.elapsed)
            else:
                free_steps.append(elapsed)
    snapshot = [r.sampling.matcher.fork() for r in json_engine.scheduler.running]

    ratio = statistics.median(j / f for j, f in zip(json_steps, free_steps))
    free, masked = statistics.median(free_steps), statistics.median(mask_steps)
    print(f"decode step, {args.seqs} rows: free median {free * 1e3:.1f} ms, JSON-constrained median "
          f"{statistics.median(json_steps) * 1e3:.1f} ms; paired ratio median {ratio:.3f}x")
    print(f"  mask fill + apply + advance per constrained step: {masked * 1e3:.2f} ms "
          f"= {masked / free:.1%} of a free step (ratio {1 + masked / free:.3f}x from this alone)")

    bitmask = torch.empty(len(snapshot), bitmask_words(free_engine.loaded.config.vocab_size), dtype=torch.int32)
    fills = []
    for _ in range(20):
        t = time.perf_counter()
        fill_all(snapshot, bitmask)
        fills.append(time.perf_counter() - t)
    fill = statistics.median(fills)
    print(f"  fill of {len(snapshot)} masks: {fill * 1e3:.2f} ms = {fill / free:.2%} of a free step "
          f"(the most that filling during the forward could save)")

    # Compile times, on a fresh manager.
    manager = StructuredOutputManager(free_engine.tokenizer, free_engine.loaded.config.vocab_size)
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
