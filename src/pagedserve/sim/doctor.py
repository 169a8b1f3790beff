"""`pagedserve doctor`: read a serving configuration and say which of the three defaults
(paged KV pool, continuous batching limits, chunked prefill budget) is off or
mis-sized, with the numbers, and what to change. Speculative-decoding options are
checked against spec_decode_matrix.json (data, not code).

`--simulate` runs each finding's fix on a workload built to exercise it and recommends
only what that simulation supports on the objective (`Objective`): a fix that loses is
replaced by the best of its alternatives, or stated as a trade-off."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ..workload.datasets import BenchRequest, mixed_dataset, random_dataset, shared_prefix_dataset
from ..workload.serving_stats import CLASS_TTFT
from ..core.scheduler_config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GPU_DEFAULT_MAX_NUM_SEQS,
    SCHEDULING_POLICIES,
)
from ..core.step_budget import LatencyTarget, choose_budget
from .cost_model import CostModel
from .scenario import Scenario, build_scenario

# A step this many times the full-batch decode step is a visible stall for every stream.
STALL_FACTOR = 2.0
MAX_GPU_MEMORY_UTILIZATION = 0.95
MIN_GPU_MEMORY_UTILIZATION = 0.8
# The ITL the stall rule holds a full-budget step to when the user names no target.
DEFAULT_ITL_TARGET_MS = 50.0
# The simulated figures every impact reports.
METRICS = ("output_throughput", "p99_itl_ms", "p99_ttft_ms", "num_preemptions")


@dataclass
class ServeConfig:
    """The serve flags doctor understands (vLLM names), with vLLM-like GPU defaults."""

    model: str = "llama-3.1-8b"
    hardware: str = "h100-sxm5"
    dtype: str = "bf16"
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = GPU_DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = None
    vllm_version: str | None = None  # for the compatibility matrix; default: its latest_known
    # p99 latency targets (the objective's constraints). With budget_by_target the server
    # also sizes each step from them (pagedserve serve --itl-target-ms, core/step_budget.py)
    # instead of the fixed max_num_batched_tokens.
    itl_target_ms: float | None = None
    ttft_target_ms: float | None = None
    budget_by_target: bool = False
    scheduling_policy: str = "fcfs"  # or "priority": requests' classes order the queue and preempt

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> "ServeConfig":
        names = {f.name for f in fields(cls)}
        aliases = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}
        clean = {aliases.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in values.items()}
        unknown = sorted(set(clean) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(names)}")
        if isinstance(clean.get("speculative_config"), str):
            clean["speculative_config"] = json.loads(clean["speculative_config"])
        return cls(**clean)


def load_config_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise ValueError(f"config {path}: YAML needs PyYAML; use a JSON file instead") from e
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must hold a mapping of serve flags")
    return data


@dataclass
class Finding:
    id: str
    severity: str
    message: str
    fix: str
    # Config changes that apply the fix; doctor --simulate quantifies them.
    change: dict[str, Any] = field(default_factory=dict)
    # The workload (WORKLOADS) that exercises the change, and the other changes to try,
    # in order, when the first loses on the objective.
    workload: str | None = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    # What the fix protects against that the simulator does not model (it then stays
    # recommended when its simulation loses, with the cost stated).
    unmodelled: str | None = None
    impact: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scenario_for(cfg: ServeConfig, clamp: bool = True) -> Scenario:
    return build_scenario(cfg.model, cfg.hardware, cfg.dtype, cfg.kv_cache_dtype, cfg.tensor_parallel_size,
                          cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                          cfg.gpu_memory_utilization, None, cfg.enable_prefix_caching, clamp_max_model_len=clamp)


def diagnose(cfg: ServeConfig) -> list[Finding]:
    findings: list[Finding] = []
    if cfg.max_num_seqs > cfg.max_num_batched_tokens:
        findings.append(Finding(
            "budget-below-max-num-seqs", "error",
            f"max_num_seqs ({cfg.max_num_seqs}) exceeds max_num_batched_tokens ({cfg.max_num_batched_tokens}): "
            "running decodes take one token each and go first, so the ones past the budget would starve",
            f"raise --max-num-batched-tokens to at least {cfg.max_num_seqs} or lower --max-num-seqs",
            {"max_num_batched_tokens": cfg.max_num_seqs}, "many-short",
            [{"max_num_seqs": cfg.max_num_batched_tokens}]))
    try:
        sc = scenario_for(cfg, clamp=False)
    except ValueError as e:
        findings.append(Finding("kv-pool-empty", "error", str(e),
                                "raise --tensor-parallel-size, use --dtype fp8, or raise --gpu-memory-utilization"))
        return findings + _speculative(cfg)
    findings += _memory(cfg, sc)
    findings += _budget(cfg, sc)
    findings += _latency_target(cfg, sc)
    findings += _blocks(cfg)
    return findings + _speculative(cfg)


def _memory(cfg: ServeConfig, sc: Scenario) -> list[Finding]:
    out = []
    pool_tokens, mml = sc.plan.num_tokens, sc.max_model_len
    gib = sc.plan.kv_pool_bytes / 2**30
    if mml > pool_tokens:
        out.append(Finding(
            "max-model-len-exceeds-pool", "error",
            f"max_model_len {mml:,} tokens needs {mml * sc.plan.kv_bytes_per_token / 2**30:.2f} GiB of KV, but the "
            f"pool has {gib:.2f} GiB = {pool_tokens:,} tokens: one full-length request could never run",
            f"set --max-model-len {pool_tokens:,} or less, or free memory (fp8 KV, higher tp)",
            {"max_model_len": pool_tokens}, "long-prompts"))
        mml = pool_tokens
    fit = pool_tokens // mml
    if fit < cfg.max_num_seqs:
        out.append(Finding(
            "kv-pool-vs-max-num-seqs", "warning",
            f"the KV pool ({gib:.2f} GiB, {pool_tokens:,} tokens in {sc.plan.num_blocks:,} blocks) holds {fit} "
            f"full-length ({mml:,}-token) sequences but max_num_seqs is {cfg.max_num_seqs}: once sequences grow, "
            "the scheduler preempts and recomputes instead of batching more",
            f"lower --max-num-seqs towards {max(1, fit)} for long-context traffic, or grow the pool "
            "(--kv-cache-dtype fp8, higher --tensor-parallel-size, lower --max-model-len)",
            {"max_num_seqs": max(1, fit)}, "growth",
            # From the current value down to what the pool holds at full length: the
            # search stops once two halvings in a row lose (see _best_change).
            [{"max_num_seqs": n} for n in _halvings(cfg.max_num_seqs, max(1, fit))]))
    util = cfg.gpu_memory_utilization
    if util > MAX_GPU_MEMORY_UTILIZATION:
        out.append(Finding(
            "memory-utilization-high", "warning",
            f"gpu_memory_utilization {util} leaves {(1 - util) * sc.plan.memory_bytes / 2**30:.2f} GiB for everything "
            "outside the profiled forward (allocator fragmentation, other processes): out-of-memory risk",
            f"use at most {MAX_GPU_MEMORY_UTILIZATION}", {"gpu_memory_utilization": 0.9}, "growth",
            unmodelled="headroom against out-of-memory errors"))
    elif util < MIN_GPU_MEMORY_UTILIZATION:
        idle = (0.9 - util) * sc.plan.memory_bytes
        out.append(Finding(
            "memory-utilization-low", "warning",
            f"gpu_memory_utilization {util} leaves {idle / 2**30:.2f} GiB idle that at 0.9 would hold "
            f"{int(idle // sc.plan.kv_bytes_per_token):,} more KV tokens (pool now {pool_tokens:,})",
            "use --gpu-memory-utilization 0.9 unless another process shares the GPU",
            {"gpu_memory_utilization": 0.9}, "growth"))
    return out


def _stall_step_s(cost: CostModel, budget: int, num_decodes: int, context: int) -> float:
    """A step that fills the budget: running decodes plus one prefill chunk."""
    decodes = min(num_decodes, budget)
    rows = [(1, context)] * decodes + ([(budget - decodes, 0)] if budget > decodes else [])
    return cost.cost(rows, decodes).seconds


def _budget(cfg: ServeConfig, sc: Scenario) -> list[Finding]:
    out = []
    budget, mml = cfg.max_num_batched_tokens, sc.max_model_len
    if not cfg.enable_chunked_prefill and budget < mml:
        out.append(Finding(
            "budget-below-longest-prompt", "error",
            f"chunked prefill is off and max_num_batched_tokens ({budget:,}) is below max_model_len ({mml:,}): "
            "a prompt longer than the budget can never be scheduled whole",
            f"enable chunked prefill (keeps decodes moving) or raise --max-num-batched-tokens to {mml:,}",
            {"enable_chunked_prefill": True}, "mixed",
            [{"enable_chunked_prefill": True, "max_num_batched_tokens": b}
             for b in _doublings(max(budget, cfg.max_num_seqs), min(mml, 8 * DEFAULT_MAX_NUM_BATCHED_TOKENS))[1:]]))
    if cfg.enable_chunked_prefill and not cfg.budget_by_target:
        cost = sc.cost
        context, decodes = typical_decodes(cfg, sc)
        decode_s = cost.cost([(1, context)] * decodes, decodes).seconds
        limit = max((cfg.itl_target_ms or DEFAULT_ITL_TARGET_MS) / 1e3, STALL_FACTOR * decode_s)
        step_s = _stall_step_s(cost, budget, decodes, context)
        if step_s > limit:
            good = budget
            while good > cfg.max_num_seqs and _stall_step_s(cost, good, decodes, context) > limit:
                good = max(cfg.max_num_seqs, good // 2)
            out.append(Finding(
                "chunk-stalls-decodes", "warning",
                f"a full {budget:,}-token step with {decodes} decodes takes ~{step_s * 1e3:.0f} ms (cost model) versus "
                f"{decode_s * 1e3:.0f} ms for decodes alone: every stream's inter-token latency jumps to that "
                f"(limit {limit * 1e3:.0f} ms = max(ITL target, {STALL_FACTOR:g} x decode step))",
                f"lower --max-num-batched-tokens to about {good:,} "
                f"(~{_stall_step_s(cost, good, decodes, context) * 1e3:.0f} ms per step)",
                {"max_num_batched_tokens": good}, "mixed",
                [{"max_num_batched_tokens": b} for b in _doublings(good, budget)][1:-1]
                + [{"budget_by_target": True, "itl_target_ms": cfg.itl_target_ms or DEFAULT_ITL_TARGET_MS}]))
    return out


def typical_decodes(cfg: ServeConfig, sc: Scenario) -> tuple[int, int]:
    """(context, decodes) of a typical decode load: as many decodes as the pool holds at a
    1k context, at most max_num_seqs."""
    context = min(1024, sc.max_model_len)
    return context, min(cfg.max_num_seqs, max(1, sc.plan.num_tokens // context))


def _latency_target(cfg: ServeConfig, sc: Scenario) -> list[Finding]:
    """Given an ITL target, what the latency-target budget (the one the server uses with
    --itl-target-ms) would pick per step at a typical decode load on this device."""
    if cfg.itl_target_ms is None or not cfg.enable_chunked_prefill:
        return []
    context, decodes = typical_decodes(cfg, sc)
    cap = sc.target_cap()
    model = sc.cost.step_time_model(cap)
    target = LatencyTarget(cfg.itl_target_ms / 1e3, None if cfg.ttft_target_ms is None else cfg.ttft_target_ms / 1e3)
    budget = choose_budget(model, target, cap, decodes, decodes * context, context)
    decode_ms = model.decode_seconds(decodes, decodes * context) * 1e3
    if budget <= decodes:
        detail = (f"the {decodes} decodes alone take ~{decode_ms:.0f} ms, over the target: each step adds only the "
                  f"{target.min_chunk}-token minimum chunk; lower --max-num-seqs or the context to meet it")
    else:
        detail = f"{decodes} decodes (~{decode_ms:.0f} ms) plus {budget - decodes:,} prefill tokens"
    already = "" if cfg.budget_by_target else f" versus the fixed --max-num-batched-tokens {cfg.max_num_batched_tokens:,}"
    return [Finding(
        "latency-target-budget", "info",
        f"with --itl-target-ms {cfg.itl_target_ms:g}, a step at a typical load ({decodes} decodes of {context:,} "
        f"context) gets a budget of {budget:,} tokens (choose_budget on the {cfg.hardware} cost model, cap "
        f"{cap:,}): {detail}{already}",
        f"pagedserve serve --itl-target-ms {cfg.itl_target_ms:g} sizes every step this way; vLLM: "
        f"--max-num-batched-tokens {budget:,}",
        {} if cfg.budget_by_target else {"budget_by_target": True}, "mixed",
        [] if cfg.budget_by_target else [{"max_num_batched_tokens": max(budget, cfg.max_num_seqs)}])]


def _blocks(cfg: ServeConfig) -> list[Finding]:
    bs = cfg.block_size
    out = []
    if bs > 32:
        out.append(Finding(
            "block-size-coarse", "warning",
            f"block_size {bs}: prefixes are shared only in whole blocks (a hit loses up to {bs - 1} tokens, "
            f"{(bs - 1) / 2:.0f} on average) and each sequence's last block wastes {(bs - 1) / 2:.0f} slots on average",
            "use --block-size 16 (or 32)", {"block_size": 16}, "shared-prefix", [{"block_size": 32}]))
    elif bs < 16:
        out.append(Finding(
            "block-size-fine", "info",
            f"block_size {bs}: {16 // bs}x the blocks of the default per sequence: longer block tables, more "
            "hashing and allocation work per token, for at most 7.5 fewer wasted slots per sequence",
            "use --block-size 16", {"block_size": 16}, "shared-prefix"))
    if not cfg.enable_prefix_caching:
        out.append(Finding(
            "prefix-caching-off", "info",
            "prefix caching is off: shared system prompts and preempted requests are recomputed from scratch",
            "enable prefix caching (--enable-prefix-caching)", {"enable_prefix_caching": True}, "shared-prefix"))
    return out


def load_matrix() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("spec_decode_matrix.json").read_text())


def _version(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.lstrip("v").split("."))
    except ValueError as e:
        raise ValueError(f"vllm_version must look like 0.18.0, got {v!r}") from e


def _speculative(cfg: ServeConfig) -> list[Finding]:
    spec = cfg.speculative_config
    if not spec:
        return []
    matrix = load_matrix()
    version = cfg.vllm_version or matrix["latest_known"]
    v = _version(version)
    method = spec.get("method", "draft_model" if spec.get("model") else None)
    out = []
    if method not in matrix["methods"]:
        out.append(Finding("spec-method-unknown", "warning",
                           f"speculative method {method!r} is not in the compatibility matrix",
                           f"use one of {', '.join(matrix['methods'])} (eagle3 is the common default)",
                           {"speculative_config": {**spec, "method": "eagle3"}}))
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        out.append(Finding("spec-num-tokens", "error",
                           f"num_speculative_tokens must be an integer >= 1, got {k!r}",
                           "set num_speculative_tokens (2-5 is typical)", {}))
    in_use = {"speculation": True, "pipeline_parallel": cfg.pipeline_parallel_size > 1,
              "chunked_prefill": cfg.enable_chunked_prefill, "prefix_caching": cfg.enable_prefix_caching}
    for rule in matrix["rules"]:
        methods = rule["methods"]
        if not in_use[rule["feature"]] or (methods != "*" and method not in methods):
            continue
        through = rule.get("incompatible_through")
        if through is not None and v <= _version(through):
            out.append(Finding(
                f"spec-{rule['feature'].replace('_', '-')}-incompatible", "error",
                f"{rule['note']} is incompatible in vLLM {version} (through v{through})",
                f"use vLLM newer than v{through}, or drop the combination", {}))
        verified = rule.get("verified_in")
        if verified and v < min(_version(x) for x in verified):
            out.append(Finding(
                f"spec-{rule['feature'].replace('_', '-')}-unverified", "info",
                f"{rule['note']} is known to work from v{min(verified, key=_version)}; not verified in {version}",
                f"test the combination, or use vLLM v{min(verified, key=_version)}+", {}))
    return out


def _halvings(start: int, stop: int) -> list[int]:
    """start/2, start/4, ... down to stop (included), for a search below the current value."""
    out, n = [], start
    while n > stop:
        n = max(stop, n // 2)
        out.append(n)
    return out


def _doublings(start: int, stop: int) -> list[int]:
    """start, 2 start, ... up to stop (included)."""
    out, n = [start], start
    while n < stop:
        n = min(stop, n * 2)
        out.append(n)
    return out


@dataclass(frozen=True)
class Objective:
    """What "better" means, on the simulator's figures: the most output throughput, or the
    lowest p99 ITL, subject to p99 latency targets and a throughput floor."""

    goal: str = "throughput"  # or "itl"
    itl_target_ms: float | None = None
    ttft_target_ms: float | None = None
    min_throughput: float | None = None

    def __post_init__(self) -> None:
        if self.goal not in ("throughput", "itl"):
            raise ValueError(f"objective goal must be 'throughput' or 'itl', got {self.goal!r}")

    def violation(self, m: dict[str, float]) -> float:
        """How far past its constraints a result is, as a sum of relative excesses (0: meets all)."""
        over = 0.0
        if self.itl_target_ms is not None:
            over += max(0.0, m["p99_itl_ms"] / self.itl_target_ms - 1)
        if self.ttft_target_ms is not None:
            # With priority classes the target is the most urgent class's (the others are batch work).
            over += max(0.0, m.get("p99_ttft_high_ms", m["p99_ttft_ms"]) / self.ttft_target_ms - 1)
        if self.min_throughput is not None:
            over += max(0.0, 1 - m["output_throughput"] / self.min_throughput)
        return over

    def value(self, m: dict[str, float]) -> float:
        return m["output_throughput"] if self.goal == "throughput" else -m["p99_itl_ms"]

    def key(self, m: dict[str, float] | None) -> tuple[int, float, float]:
        """Larger is better: a configuration that runs beats one that cannot; one that meets
        the constraints beats one that misses them (the nearer miss first); then the goal."""
        if m is None or "error" in m:
            return (0, -math.inf, -math.inf)
        v = self.violation(m)
        return (1, -v, self.value(m)) if v else (2, 0.0, self.value(m))

    def gain(self, before: dict[str, float] | None, after: dict[str, float] | None) -> float:
        """The change's simulated impact, for ordering findings: the goal's relative change
        when both meet the constraints alike; infinite when the fix makes a failing
        configuration run or meet them."""
        kb, ka = self.key(before), self.key(after)
        if ka[:2] != kb[:2]:
            return math.inf if ka > kb else -math.inf
        if kb[0] == 0:
            return 0.0
        return (ka[2] - kb[2]) / max(abs(kb[2]), 1e-9)

    def describe(self) -> str:
        goal = "max output throughput" if self.goal == "throughput" else "min p99 ITL"
        limits = []
        if self.itl_target_ms is not None:
            limits.append(f"p99 ITL <= {self.itl_target_ms:g} ms")
        if self.ttft_target_ms is not None:
            limits.append(f"p99 TTFT <= {self.ttft_target_ms:g} ms")
        if self.min_throughput is not None:
            limits.append(f"throughput >= {self.min_throughput:g} tok/s")
        return goal + (" subject to " + ", ".join(limits) if limits else "")


def _long_prompts(cfg: ServeConfig, sc: Scenario, seed: int) -> list[BenchRequest]:
    """Prompts from a fifth of the pool to past it: the longest are what max_model_len admits or refuses."""
    return random_dataset(16, max(16, int(sc.plan.num_tokens * 0.65)), 32, 0.75, seed=seed)


def _growth(cfg: ServeConfig, sc: Scenario, seed: int) -> list[BenchRequest]:
    """More requests than the pool holds once they have grown: each is admitted at its prompt
    and then grows by its output, so an over-committed max_num_seqs preempts."""
    # Lengths spread by a quarter either way: the longest still within max_model_len.
    total = min(int(sc.max_model_len / 1.25), max(1024, sc.plan.num_tokens // 8))
    output = min(total // 2, 512)
    n = min(64, max(32, 4 * sc.plan.num_tokens // total))
    return random_dataset(n, total - output, output, 0.25, seed=seed)


def _mixed(cfg: ServeConfig, sc: Scenario, seed: int) -> list[BenchRequest]:
    """Short prompts decoding while every 8th request brings a long prompt to prefill beside them."""
    # Lengths spread by a quarter either way: the longest prompt and its output still fit.
    long = max(256, min(int(sc.max_model_len / 1.25) - 160, 8192, sc.plan.num_tokens // 4))
    return mixed_dataset(64, 256, long, 8, 128, 0.25, seed=seed)


def _shared_prefix(cfg: ServeConfig, sc: Scenario, seed: int) -> list[BenchRequest]:
    """Groups sharing a system prompt whose length is not a multiple of the block size."""
    return shared_prefix_dataset(64, 4, 1000, 100, 64, 0.25, seed=seed)


def _many_short(cfg: ServeConfig, sc: Scenario, seed: int) -> list[BenchRequest]:
    """More short requests than either limit, so that both the budget and max_num_seqs bind."""
    n = min(512, max(cfg.max_num_seqs, cfg.max_num_batched_tokens) + 64)
    return random_dataset(n, 128, 64, 0.25, seed=seed)


WORKLOADS = {"long-prompts": _long_prompts, "growth": _growth, "mixed": _mixed,
             "shared-prefix": _shared_prefix, "many-short": _many_short}


def simulate_config(cfg: ServeConfig, requests: list[BenchRequest], concurrency: int | None = None,
                    request_rate: float = math.inf, seed: int = 0, clamp: bool = True) -> dict[str, float]:
    """The simulated figures of one configuration on a workload. Requests longer than its
    max_model_len are refused at admission, as the server answers them (HTTP 400), and
    counted; a configuration that cannot start raises ValueError (clamp=False keeps a
    max_model_len beyond the pool, which vLLM refuses to start with)."""
    from .simulator import simulate

    sc = scenario_for(cfg, clamp)
    if sc.max_model_len > sc.plan.num_tokens:
        raise ValueError(f"max_model_len {sc.max_model_len:,} exceeds the KV pool ({sc.plan.num_tokens:,} tokens): "
                         "vLLM refuses to start")
    admitted = [r for r in requests if r.prompt_len + r.output_len <= sc.max_model_len]
    if not admitted:
        raise ValueError(f"every request exceeds max_model_len {sc.max_model_len:,}")
    policy = "chunked" if cfg.enable_chunked_prefill else "continuous"
    targets = (cfg.itl_target_ms, cfg.ttft_target_ms) if cfg.budget_by_target and policy == "chunked" else (None, None)
    s = simulate(admitted, sc.cost, sc.sim_config(policy, concurrency, request_rate, seed, *targets,
                                                  scheduling_policy=cfg.scheduling_policy)).summary()
    out = {k: round(s[k], 2) for k in METRICS}
    out["rejected"] = len(requests) - len(admitted)
    urgent = CLASS_TTFT + str(min(r.priority for r in admitted))
    if urgent in s:  # several classes: the most urgent one's TTFT
        out["p99_ttft_high_ms"] = round(s[urgent], 2)
    return out


def diagnose_priorities(cfg: ServeConfig, requests: list[BenchRequest], concurrency: int | None = None,
                        request_rate: float = math.inf, seed: int = 0) -> list[Finding]:
    """A workload of several priority classes served first come, first served while its most
    urgent class misses the p99 TTFT target: --scheduling-policy priority, simulated on that
    workload, recommended when it brings that class's TTFT down (and whether it meets the target)."""
    classes = sorted({r.priority for r in requests})
    target = cfg.ttft_target_ms
    if len(classes) < 2 or cfg.scheduling_policy == "priority" or target is None:
        return []
    change = {"scheduling_policy": "priority"}
    try:
        before = simulate_config(cfg, requests, concurrency, request_rate, seed)
        if before.get("p99_ttft_high_ms", 0.0) <= target:
            return []
        after = simulate_config(ServeConfig(**{**asdict(cfg), **change}), requests, concurrency, request_rate, seed)
    except ValueError:
        return []  # the configuration cannot run this workload; diagnose() says why
    if after["p99_ttft_high_ms"] >= before["p99_ttft_high_ms"]:
        return []
    verdict = "meets" if after["p99_ttft_high_ms"] <= target else "still misses"
    f = Finding(
        "priority-classes-served-fcfs", "warning",
        f"the workload has priority classes {classes}, but fcfs serves them in arrival order: the most urgent "
        f"class ({classes[0]}) has p99 TTFT {before['p99_ttft_high_ms']:,.0f} ms against the {target:g} ms target",
        f"--scheduling-policy priority: that class's p99 TTFT becomes {after['p99_ttft_high_ms']:,.0f} ms ({verdict} "
        f"the target); all requests: {format_figures(before)} -> {format_figures(after)}", change)
    f.impact = {"workload": f"the given workload: {len(requests)} requests in {len(classes)} priority classes",
                "objective": f"p99 TTFT of priority {classes[0]} <= {target:g} ms", "before": before, "after": after,
                "change": change, "rule_change": change}
    return [f]


def _try(cfg: ServeConfig, requests: list[BenchRequest], concurrency: int | None,
         clamp: bool = True) -> dict[str, Any]:
    try:
        return simulate_config(cfg, requests, concurrency, clamp=clamp)
    except ValueError as e:
        return {"error": str(e)}


def _best_change(cfg: ServeConfig, f: Finding, requests: list[BenchRequest], concurrency: int | None,
                 objective: Objective, clamp: bool) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(change, figures) for the rule's change and then its alternatives, best first. The
    alternatives are ordered (a numeric walk away from the current value), so the walk
    stops once two in a row lose to the best so far: the figures are unimodal in practice."""
    tried = []
    best_key, misses = None, 0
    for change in [f.change, *f.alternatives]:
        figures = _try(ServeConfig(**{**asdict(cfg), **change}), requests, concurrency, clamp)
        tried.append((change, figures))
        key = objective.key(figures)
        if best_key is None or key > best_key:
            best_key, misses = key, 0
        else:
            misses += 1
            if misses == 2:
                break
    return sorted(tried, key=lambda t: objective.key(t[1]), reverse=True)


def cli_flag(name: str, value: Any) -> str:
    """A ServeConfig field as its serve flag (booleans as --x / --no-x)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def _flags(change: dict[str, Any]) -> str:
    # budget_by_target has no flag of its own: --itl-target-ms turns it on.
    return " ".join(cli_flag(k, v) for k, v in change.items() if k != "budget_by_target")


def format_figures(m: dict[str, Any]) -> str:
    if "error" in m:
        return f"cannot run ({m['error']})"
    text = (f"{m['output_throughput']:,.0f} tok/s, p99 ITL {m['p99_itl_ms']:,.0f} ms, "
            f"p99 TTFT {m['p99_ttft_ms']:,.0f} ms, {m['num_preemptions']:,} preemptions")
    return text + (f", {m['rejected']} refused as too long" if m.get("rejected") else "")


def quantify(cfg: ServeConfig, findings: list[Finding], concurrency: int | None = None,
             objective: Objective = Objective(), seed: int = 0) -> list[Finding]:
    """doctor --simulate: each finding's change (and its alternatives) against doing nothing,
    on the workload that exercises it. A change that loses on the objective is replaced by
    the best alternative that wins, or, when none does, withdrawn and stated as a trade-off.
    Returns the findings ordered by simulated impact (the largest gain first; findings
    without a simulation keep their order after them)."""
    try:
        sc = scenario_for(cfg)
    except ValueError:
        return findings
    gains: dict[int, float] = {}
    for i, f in enumerate(findings):
        if not f.change or f.workload is None:
            continue
        requests = WORKLOADS[f.workload](cfg, sc, seed)
        # The max_model_len rule is about the unclamped length; every other rule is judged
        # on the configuration as it would start (clamped to the pool, as `sim` does).
        clamp = f.id != "max-model-len-exceeds-pool"
        before = _try(cfg, requests, concurrency, clamp)
        tried = _best_change(cfg, f, requests, concurrency, objective, clamp)
        best_change, best = tried[0]
        proposed = next(m for c, m in tried if c is f.change)
        gain = objective.gain(before, best)
        f.impact = {"workload": f"{f.workload}: {len(requests)} requests", "objective": objective.describe(),
                    "before": before, "after": best, "change": best_change, "rule_change": f.change,
                    "tried": [{"change": c, **m} for c, m in tried]}
        gains[i] = gain
        if gain <= 0 and f.unmodelled:
            f.fix += (f" (costs {format_figures(before)} -> {format_figures(proposed)} in simulation; it buys "
                      f"{f.unmodelled}, which the simulator does not model)")
            f.impact["after"], f.impact["change"] = proposed, f.change
        elif gain > 0:
            if best_change is not f.change:
                f.fix = (f"{_flags(best_change)} (best of {len(tried)} simulated; the rule's own "
                         f"{_flags(f.change)} gives {format_figures(proposed)})")
                f.change = best_change
        else:
            # Nothing tried beats the current setting: withdraw the change, give the numbers.
            f.fix = (f"not recommended on {objective.describe()}: {_flags(f.change)} gives {format_figures(proposed)} "
                     f"versus {format_figures(before)} now (the trade-off); keep the current setting unless that trade "
                     f"is wanted. Rule's advice: {f.fix}")
            f.change = {}
            f.impact["after"], f.impact["change"] = proposed, {}
    order = sorted(range(len(findings)), key=lambda i: (i not in gains, -gains.get(i, 0.0), i))
    return [findings[i] for i in order]
