"""`sim calibrate` and `sim twin`: measure this CPU, then compare the real engine with the
simulator on the same small workload. The only module of pagedserve.sim that uses torch
(imported inside the functions, so `import pagedserve.sim...` never loads it)."""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import replace

from ..core.kv_tensor_layout import KVTensorLayout
from .cost_model import CostModel
from .hardware import Calibration, Ladder, MeasuredRates

TWIN_MODEL = "smollm2-135m"
TWIN_VOCAB = 49_152


# Step token counts at which the linear layers' and the head's achieved rates are measured:
# decode batches up to whole-prompt prefills.
LADDER_ROWS = (1, 4, 16, 64, 256, 1024)
# Attention steps that separate its three costs: a fixed cost per layer call (one short
# decode), K/V reads (many long decodes), and FLOPs (one causal prefill).
ATTENTION_PROBES = {"call": [(1, 15)], "kv": [(1, 255)] * 32, "flops": [(256, 0)]}
# Real engine steps (decode batch sizes, prefill lengths) whose time outside the calibrated
# primitives gives the step overhead and its per-token part.
OVERHEAD_DECODE_BATCHES = (1, 8, 32)
OVERHEAD_PREFILL_LEN = 256
# The same decode step (this many rows) timed this many times in a row: how much a
# step's time varies on this machine, which the simulator's tails need (step_spread).
SPREAD_DECODE_ROWS = 16
SPREAD_STEPS = 200


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(m: int = 512, k: int = 1024, n: int = 1024) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b), 10)


def _engine(policy: str = "chunked", **options):
    """The engine the twin measures: fp32 weights and cache, which the cost model prices
    (CostModel(..., "fp32")), whatever the default quantization."""
    from ..engine.llm import LLM

    return LLM(policy=policy, quantization="none", kv_cache_dtype="fp32", **options)


def interleaved_medians(fns: list, rounds: int) -> list[float]:
    """Median seconds of each function, timed in turn round after round (after a warm-up
    round), so that a change in the shared machine's load reaches all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds + 1):
        for fn, record in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            if r:
                record.append(time.perf_counter() - t0)
    return [statistics.median(record) for record in times]


def measure_linear_ladders(model, rows: tuple[int, ...] = LADDER_ROWS, rounds: int = 5) -> tuple[Ladder, Ladder]:
    """Achieved FLOP/s of the model's own linear layers at each row count: every layer's
    qkv, o, gate_up and down in turn (so, as in a forward, no weight stays in cache from
    one call to the next), and the LM head."""
    import torch

    c = model.config
    body_flops_per_row = 2 * (c.num_params - c.vocab_size * c.hidden_size)
    head_flops_per_row = 2 * c.vocab_size * c.hidden_size
    modules = model.linear_layers()
    fns = []
    for m in rows:
        inputs = {f: torch.randn(m, f) for f in (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size)}

        def body(inputs=inputs):
            for lin in modules:
                lin(inputs[lin.in_features])

        fns += [body, lambda x=inputs[c.hidden_size]: model.lm_head(x)]
    with torch.inference_mode():
        t = interleaved_medians(fns, rounds)
    linear = tuple((m, body_flops_per_row * m / s) for m, s in zip(rows, t[0::2]))
    head = tuple((m, head_flops_per_row * m / s) for m, s in zip(rows, t[1::2]))
    return linear, head


def _attention_step(model, backend, kv_caches, rows: list[tuple[int, int]], block_size: int):
    """One step's attention through every layer with the engine's backend and KV caches:
    rows of (new tokens, earlier tokens), each sequence on its own run of blocks."""
    import torch

    from ..attention.metadata import AttentionMetadata

    c = model.config
    tables, first = [], 0
    for n, ctx in rows:
        blocks = -(-(n + ctx) // block_size)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    num_blocks = KVTensorLayout.of(kv_caches[0]).num_blocks
    if first > num_blocks:
        raise ValueError(f"attention probe needs {first} KV blocks; the engine has {num_blocks}")
    tokens = sum(n for n, _ in rows)
    q = torch.randn(tokens, c.num_heads, c.head_dim)
    k, v = torch.randn(2, tokens, c.num_kv_heads, c.head_dim)
    scale = c.head_dim**-0.5

    def step():
        # A new metadata object per step, so the backend plans it once, as in the engine.
        meta = AttentionMetadata.for_sequences([n for n, _ in rows], [n + ctx for n, ctx in rows], tables,
                                               block_size)
        with torch.inference_mode():
            for kv in kv_caches:
                backend.forward(q, k, v, kv, meta, scale)

    return step


def measure_attention(model, kv_caches, block_size: int, rounds: int = 7) -> tuple[float, float, float]:
    """(fixed seconds per layer call, K/V bytes/s, FLOP/s) of the CPU attention backend.

    Each probe step's time is modelled as the cost model prices it (cpu_attention_work),
    time = layers * call + KV bytes / bandwidth + prefill FLOPs / rate, and the three
    probes, each dominated by one term, are solved for the three unknowns. The probes take turns,
    round after round, so a change in the machine's load reaches all three alike."""
    import torch

    from ..attention.cpu_backend import PREFILL_MIN_QUERY_LEN
    from ..attention.selector import get_backend
    from .cost_model import attention_flops_per_pair, cpu_attention_work

    c = model.config
    backend = get_backend()
    kv_per_token, per_pair = c.kv_bytes_per_token(4), attention_flops_per_pair(c)
    a, steps = [], []
    for rows in ATTENTION_PROBES.values():
        kv_tokens, pairs = cpu_attention_work(rows, PREFILL_MIN_QUERY_LEN)
        a.append([c.num_layers, kv_per_token * kv_tokens, per_pair * pairs])
        steps.append(_attention_step(model, backend, kv_caches, rows, block_size))
    t = interleaved_medians(steps, rounds)
    call, inv_bandwidth, inv_rate = torch.linalg.solve(torch.tensor(a, dtype=torch.float64),
                                                       torch.tensor(t, dtype=torch.float64)).tolist()
    if min(call, inv_bandwidth, inv_rate) <= 0:
        raise ValueError(f"attention probes took {[f'{x * 1e3:.1f} ms' for x in t]}, which no positive call cost, "
                         "bandwidth and FLOP rate explain: the machine was too noisy; run `sim calibrate` again")
    return call, 1 / inv_bandwidth, 1 / inv_rate


class PrimitiveTimers:
    """Time spent in an engine's linear layers and attention backend while it steps: what
    is left of a step is the overhead that no calibrated primitive covers."""

    def __init__(self, engine):
        self.linear = 0.0
        self._handles = []
        # The layers the linear ladder measures, whatever their kind (fp32, GGUF blocks, int8).
        for module in engine.runner.model.linear_layers():
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop))
        self._open = ExitStack()
        self._attention = self._open.enter_context(engine.runner.attention_timer())

    @property
    def attention(self) -> float:
        return self._attention.seconds

    def _start(self, module, args):
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output):
        self.linear += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.linear = self._attention.seconds = 0.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._open.close()


def measure_step_overhead(engine, head: Ladder) -> tuple[float, float, list[tuple[int, float]]]:
    """(seconds per step, seconds per step token) the engine spends outside its linear layers,
    LM head and attention, from real decode steps at a few batch sizes and prefill steps.
    The head is not a module (tied to the embedding), so its share is taken from its
    calibrated ladder. Medians, not a least-squares line: one step that the shared machine
    stalls must not set the overhead of every step. Also returns the (tokens, residual) points."""
    from ..sampling_params import SamplingParams
    from .hardware import rate_at

    c = engine.runner.model.config
    head_per_row = 2 * c.vocab_size * c.hidden_size
    timers = PrimitiveTimers(engine)

    def timed_step(sampled: int) -> float:
        timers.reset()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        return wall - timers.linear - timers.attention - head_per_row * sampled / rate_at(head, sampled)

    decode_points: list[tuple[int, float]] = []
    prefill_points: list[tuple[int, float]] = []
    try:
        for bs in OVERHEAD_DECODE_BATCHES:
            params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
            for i in range(bs):
                engine.add_request([(i * 7919 + t * 13) % 40_000 + 100 for t in range(64)], params)
            # Prefill them all (the budget takes a few steps of them), so only decodes are timed.
            while engine.scheduler.has_pending_prefills():
                engine.step()
            decode_points.append((bs, statistics.median(timed_step(bs) for _ in range(8))))
            while engine.has_unfinished_requests():
                engine.step()
        for r in range(3):
            prompt = [(t * 31 + r * 977) % 40_000 + 100 for t in range(OVERHEAD_PREFILL_LEN)]
            engine.add_request(prompt, SamplingParams(max_tokens=1))
            prefill_points.append((OVERHEAD_PREFILL_LEN, timed_step(1)))
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        timers.close()
    fixed = statistics.median(r for _, r in decode_points)
    decode_tokens = statistics.median(t for t, _ in decode_points)
    per_token = (statistics.median(r for _, r in prefill_points) - fixed) / (OVERHEAD_PREFILL_LEN - decode_tokens)
    return max(fixed, 0.0), max(per_token, 0.0), decode_points + prefill_points


def measure_step_spread(engine) -> tuple[float, ...]:
    """Each of SPREAD_STEPS decode steps of SPREAD_DECODE_ROWS sequences over its run's
    mean, sorted. The steps differ only by one token of context each (64 -> 264), so what
    varies is the machine: a shared VM's steps measured p90 1.08x and p99 1.6x their
    median here, which a simulator pricing every step alike leaves out of its p99s."""
    from ..sampling_params import SamplingParams

    params = SamplingParams(max_tokens=SPREAD_STEPS + 2, ignore_eos=True, temperature=0)
    for i in range(SPREAD_DECODE_ROWS):
        engine.add_request([(i * 7919 + t * 13) % 40_000 + 100 for t in range(64)], params)
    while engine.scheduler.has_pending_prefills():
        engine.step()
    times = []
    for _ in range(SPREAD_STEPS):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    mean = statistics.fmean(times)
    return tuple(sorted(t / mean for t in times))


def calibrate() -> tuple[Calibration, object, list[tuple[int, float]]]:
    """Measure the CPU engine's primitives at the twin model's shapes and save them."""
    import torch

    from ..attention.cpu_backend import PREFILL_MIN_QUERY_LEN
    from ..resolved_config import default_num_threads
    from ..core.scheduler_config import MIN_WHOLE_PROMPT_BUDGET
    from ..engine.step_timing import calibration_entry

    threads = default_num_threads()
    torch.set_num_threads(threads)
    llm = _engine(max_num_batched_tokens=OVERHEAD_PREFILL_LEN, enable_prefix_caching=False)
    engine = llm.engine
    model = engine.runner.model
    linear, head = measure_linear_ladders(model)
    call, kv_bandwidth, attn_flops = measure_attention(model, engine.runner.kv_caches, engine.scheduler.block_size)
    overhead, per_token, points = measure_step_overhead(engine, head)
    spread = measure_step_spread(engine)
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    rates = MeasuredRates(linear, head, attn_flops, kv_bandwidth, call, per_token, PREFILL_MIN_QUERY_LEN)
    cal = Calibration(rates, measure_matmul_flops(2048, 2048, 2048), overhead, total, threads, TWIN_MODEL,
                      step_spread=spread)
    # The engine's latency target budgets with this fit when it serves the same shapes.
    fitted = CostModel(engine.loaded.config, cal.hardware(), "fp32").step_time_model(MIN_WHOLE_PROMPT_BUDGET)
    cal = replace(cal, step_time_model=calibration_entry(fitted, engine.loaded.config))
    return cal, cal.save(), points


def twin(num_prompts: int = 24, policies: list[str] | None = None, seed: int = 0) -> list[dict]:
    """Each policy through the real engine and through the simulator on cpu-local."""
    from ..workload.datasets import random_dataset
    from ..sampling_params import SamplingParams
    from .hardware import get_hardware
    from .models import MODELS
    from .simulator import SimConfig, simulate

    policies = policies or ["chunked", "continuous", "static", "naive"]
    # Prompts 32-128 tokens, outputs 16-64 (uniform around 80 and 40).
    requests = random_dataset(num_prompts, 80, 40, 0.6, vocab_size=TWIN_VOCAB, seed=seed)
    cost = CostModel(MODELS[TWIN_MODEL], get_hardware("cpu-local"), "fp32")
    rows = []
    for policy in policies:
        llm = _engine(policy)
        engine = llm.engine
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in requests]
        t0 = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        sched = engine.scheduler
        target = engine.config.scheduling.latency_target
        config = SimConfig(policy=policy, num_blocks=sched.kv_cache.num_blocks, block_size=sched.block_size,
                           max_num_seqs=sched.config.max_num_seqs,
                           max_num_batched_tokens=sched.config.max_num_batched_tokens,
                           max_model_len=sched.config.max_model_len,
                           enable_prefix_caching=sched.cache_config.enable_prefix_caching,
                           itl_ratio=target.itl_ratio if target is not None else None,
                           scheduling_policy=sched.config.scheduling_policy)
        res = simulate(requests, cost, config)
        sim_tput = res.summary()["output_throughput"]
        rows.append({"policy": policy, "engine_output_throughput": produced / wall,
                     "sim_output_throughput": sim_tput, "ratio": sim_tput / (produced / wall),
                     "engine_duration_s": wall, "sim_duration_s": res.duration})
    return rows
