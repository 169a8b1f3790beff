"""`pagedserve doctor --tune`: search the scheduler's configuration for one workload and one
objective in the simulator, and print the winner as serve flags.

The space is a handful of coordinates, each a small grid: the step budget (a fixed
max_num_batched_tokens, a latency target that sizes each step, or chunked prefill off),
max_num_seqs, prefix caching, block size and, on GPUs that have it, an fp8 KV cache.
Coordinate descent: starting from the given configuration, each coordinate in turn is
set to its best value with the others held, and rounds repeat until one changes nothing.
It is pruned three ways: an ordered grid (budgets, max_num_seqs) is walked outwards from
the current value and a direction stops after two values in a row lose; every
configuration is simulated once (cached); and the whole search stops after `max_evals`
simulations. The simulator is deterministic, so the result is for a given seed.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..workload.datasets import BenchRequest
from ..core.step_budget import LatencyTarget, choose_budget
from .doctor import (DEFAULT_ITL_TARGET_MS, STALL_FACTOR, Objective, ServeConfig, cli_flag, format_figures,
                     scenario_for, simulate_config, typical_decodes)

FIXED_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
MAX_NUM_SEQS = (8, 16, 32, 64, 128, 256, 512)
BLOCK_SIZES = (16, 32)
RUNNERS_UP = 3


@dataclass(frozen=True)
class Trial:
    config: ServeConfig
    figures: dict[str, Any]  # simulate_config's, or {"error": ...}


@dataclass
class TuneResult:
    objective: Objective
    default: Trial
    best: Trial
    runners_up: list[Trial]
    num_evals: int
    num_rounds: int
    workload: str

    def to_dict(self) -> dict[str, Any]:
        def trial(t: Trial) -> dict[str, Any]:
            return {"serve_flags": serve_flags(t.config), "vllm_flags": vllm_flags(t.config),
                    "config": asdict(t.config), "figures": t.figures}

        return {"objective": self.objective.describe(), "workload": self.workload, "default": trial(self.default),
                "best": trial(self.best), "best_meets_constraints": self.meets_constraints,
                "runners_up": [trial(t) for t in self.runners_up],
                "num_evals": self.num_evals, "num_rounds": self.num_rounds}

    @property
    def meets_constraints(self) -> bool:
        return "error" not in self.best.figures and self.objective.violation(self.best.figures) == 0

    def explain(self) -> str:
        lines = [f"objective: {self.objective.describe()}",
                 f"workload: {self.workload}; {self.num_evals} configurations simulated in {self.num_rounds} "
                 "rounds of coordinate descent",
                 f"best:    {format_figures(self.best.figures)}",
                 *([] if self.meets_constraints else [
                     "  no simulated configuration meets the constraints: this is the nearest miss"]),
                 f"default: {format_figures(self.default.figures)}",
                 f"  changed: {changed_flags(self.default.config, self.best.config) or 'nothing (the default is best)'}",
                 f"  pagedserve serve {serve_flags(self.best.config)}",
                 f"  vllm serve {vllm_flags(self.best.config)}",
                 "runners-up:"]
        for t in self.runners_up:
            lines.append(f"  {format_figures(t.figures)}\n    pagedserve serve {serve_flags(t.config)}")
        return "\n".join(lines)


def engine_options(c: ServeConfig) -> dict[str, Any]:
    """The configuration as pagedserve's engine options (LLM(...), `pagedserve serve` flags).
    A latency target becomes the fixed budget it picks at a typical decode load, as for
    vLLM, wherever the engine is run without the target (serve_flags prints the target)."""
    opts: dict[str, Any] = {"max_num_seqs": c.max_num_seqs, "enable_chunked_prefill": c.enable_chunked_prefill,
                            "enable_prefix_caching": c.enable_prefix_caching, "block_size": c.block_size}
    if c.enable_chunked_prefill:
        opts["max_num_batched_tokens"] = target_budget(c) if c.budget_by_target else c.max_num_batched_tokens
    if c.max_model_len is not None:
        opts["max_model_len"] = c.max_model_len
    return opts


def serve_flags(c: ServeConfig) -> str:
    """`pagedserve serve` flags (the CPU engine has no KV dtype or memory-fraction flag; those
    show in the vLLM line only)."""
    opts = engine_options(c)
    parts = []
    if c.budget_by_target and c.enable_chunked_prefill:
        del opts["max_num_batched_tokens"]
        parts.append(f"--itl-target-ms {c.itl_target_ms:g}")
        if c.ttft_target_ms is not None:
            parts.append(f"--ttft-target-ms {c.ttft_target_ms:g}")
    return " ".join([cli_flag(k, v) for k, v in opts.items()] + parts)


def changed_flags(before: ServeConfig, after: ServeConfig) -> str:
    """The vLLM flags of `after` that differ from `before`'s."""
    old = set(_vllm_parts(before))
    return " ".join(p for p in _vllm_parts(after) if p not in old)


def target_budget(c: ServeConfig) -> int:
    """vLLM has no latency target: the fixed budget it needs is the one the target picks at
    a typical decode load (the doctor's latency-target-budget figure)."""
    sc = scenario_for(c)
    context, decodes = typical_decodes(c, sc)
    cap = sc.target_cap()
    target = LatencyTarget(c.itl_target_ms / 1e3, None if c.ttft_target_ms is None else c.ttft_target_ms / 1e3)
    return max(c.max_num_seqs, choose_budget(sc.cost.step_time_model(cap), target, cap, decodes,
                                             decodes * context, context))


def _vllm_parts(c: ServeConfig) -> list[str]:
    opts = engine_options(c)
    if c.kv_cache_dtype is not None:
        opts["kv_cache_dtype"] = c.kv_cache_dtype
    if c.tensor_parallel_size > 1:
        opts["tensor_parallel_size"] = c.tensor_parallel_size
    opts["gpu_memory_utilization"] = f"{c.gpu_memory_utilization:g}"
    return [cli_flag(k, v) for k, v in opts.items()]


def vllm_flags(c: ServeConfig) -> str:
    return " ".join([f"--model <{c.model}>", *_vllm_parts(c)])


def _itl_targets(base: ServeConfig, objective: Objective) -> list[float]:
    """Latency targets to try: the objective's (and a little under it, since the p99 lands
    near the target), else the stall rule's limit at a typical decode load."""
    if objective.itl_target_ms is not None:
        return [objective.itl_target_ms, round(0.8 * objective.itl_target_ms, 1)]
    sc = scenario_for(base)
    context, decodes = typical_decodes(base, sc)
    decode_ms = sc.cost.cost([(1, context)] * decodes, decodes).seconds * 1e3
    return [round(max(DEFAULT_ITL_TARGET_MS, STALL_FACTOR * decode_ms), 1)]


# A coordinate: whether its values are ordered (walked outwards, pruned), and the
# configurations it offers given the current one.
Coordinate = tuple[bool, Callable[[ServeConfig], list[ServeConfig]]]


def coordinates(base: ServeConfig, objective: Objective) -> list[Coordinate]:
    targets = _itl_targets(base, objective)

    def fixed_budgets(c: ServeConfig) -> list[ServeConfig]:
        return [replace(c, enable_chunked_prefill=True, budget_by_target=False, max_num_batched_tokens=b)
                for b in FIXED_BUDGETS if b >= c.max_num_seqs]

    def budget_modes(c: ServeConfig) -> list[ServeConfig]:
        return ([replace(c, enable_chunked_prefill=True, budget_by_target=True, itl_target_ms=t,
                         ttft_target_ms=objective.ttft_target_ms) for t in targets]
                + [replace(c, enable_chunked_prefill=False, budget_by_target=False)])

    def seqs(c: ServeConfig) -> list[ServeConfig]:
        # A fixed chunked budget below max_num_seqs starves decodes (a doctor error).
        fixed = c.enable_chunked_prefill and not c.budget_by_target
        return [replace(c, max_num_seqs=n) for n in MAX_NUM_SEQS if not fixed or n <= c.max_num_batched_tokens]

    hw = scenario_for(base).hardware
    kv_dtypes = [None] + (["fp8"] if hw.measured is None and "fp8" in hw.flops and base.dtype != "fp8"
                          and base.kv_cache_dtype != "fp8" else [])
    return [
        (True, fixed_budgets),
        (False, budget_modes),
        (True, seqs),
        (False, lambda c: [replace(c, enable_prefix_caching=v) for v in (True, False)]),
        (False, lambda c: [replace(c, block_size=b) for b in BLOCK_SIZES]),
        (False, lambda c: [replace(c, kv_cache_dtype=d) for d in kv_dtypes]),
    ]


def tune(base: ServeConfig, requests: Sequence[BenchRequest], objective: Objective,
         concurrency: int | None = None, request_rate: float = math.inf, seed: int = 0,
         max_evals: int = 40, max_rounds: int = 3) -> TuneResult:
    cache: dict[str, Trial] = {}
    requests = list(requests)

    def run(c: ServeConfig) -> Trial | None:
        key = json.dumps(asdict(c), sort_keys=True)
        if key not in cache:
            if len(cache) >= max_evals:
                return None
            try:
                figures = simulate_config(c, requests, concurrency, request_rate, seed)
            except ValueError as e:
                figures = {"error": str(e)}
            cache[key] = Trial(c, figures)
        return cache[key]

    def score(t: Trial) -> tuple:
        return objective.key(t.figures)

    default = run(base)
    assert default is not None
    current, rounds = default, 0
    for rounds in range(1, max_rounds + 1):
        start = current
        for ordered, offer in coordinates(base, objective):
            options = offer(current.config)
            if ordered:
                current = _walk(options, current, run, score)
            else:
                for c in options:
                    t = run(c)
                    if t is not None and score(t) > score(current):
                        current = t
        if current is start:
            break
    # Among equals, the configuration nearest the given one: fewest flags to change.
    given = asdict(base)
    ranked = sorted(cache.values(), reverse=True,
                    key=lambda t: (score(t), -sum(v != given[k] for k, v in asdict(t.config).items())))
    best = ranked[0] if score(ranked[0]) > score(default) else default
    # Runners-up that differ in their figures: a flag with no effect on this workload
    # (max_num_seqs above the concurrency) would otherwise fill the list with copies.
    runners: list[Trial] = []
    for t in ranked:
        if "error" not in t.figures and all(t.figures != u.figures for u in [best, *runners]):
            runners.append(t)
    runners = runners[:RUNNERS_UP]
    return TuneResult(objective, default, best, runners, len(cache), rounds, f"{len(requests)} requests")


def _walk(options: list[ServeConfig], current: Trial, run: Callable[[ServeConfig], Trial | None],
          score: Callable[[Trial], tuple]) -> Trial:
    """The best of an ordered grid, walked outwards from the option nearest the current
    configuration; a direction stops once two options in a row lose to the best so far."""
    if not options:
        return current
    # The nearest option: the one differing from the current configuration in fewest fields.
    now = asdict(current.config)
    here = min(range(len(options)), key=lambda i: sum(v != now[k] for k, v in asdict(options[i]).items()))
    start = run(options[here])
    if start is None:
        return current
    best = max((current, start), key=score)
    for step in (1, -1):
        misses, i = 0, here + step
        while 0 <= i < len(options) and misses < 2:
            t = run(options[i])
            if t is None:
                return best
            if score(t) > score(best):
                best, misses = t, 0
            else:
                misses += 1
            i += step
    return best
