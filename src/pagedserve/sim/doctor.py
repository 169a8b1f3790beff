"""`pagedserve doctor`: read a serving configuration and say which of the three defaults
(paged KV pool, continuous batching limits, chunked prefill budget) is off or
mis-sized, with the numbers, and what to change. Speculative-decoding options are
checked against spec_decode_matrix.json (data, not code)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from .cost_model import CostModel
from .scenario import DEFAULT_CHUNK_BUDGET, Scenario, build_scenario

SEVERITIES = ("error", "warning", "info")
# A step this many times the full-batch decode step is a visible stall for every stream.
STALL_FACTOR = 2.0
MAX_GPU_MEMORY_UTILIZATION = 0.95
MIN_GPU_MEMORY_UTILIZATION = 0.8


@dataclass
class ServeConfig:
    """The serve flags doctor understands (vLLM names), with vLLM-like GPU defaults."""

    model: str = "llama-3.1-8b"
    hardware: str = "h100-sxm5"
    dtype: str = "bf16"
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_CHUNK_BUDGET
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = None
    vllm_version: str | None = None  # for the compatibility matrix; default: its latest_known
    itl_target_ms: float = 50.0

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
            {"max_num_batched_tokens": cfg.max_num_seqs}))
    try:
        sc = scenario_for(cfg, clamp=False)
    except ValueError as e:
        findings.append(Finding("kv-pool-empty", "error", str(e),
                                "raise --tensor-parallel-size, use --dtype fp8, or raise --gpu-memory-utilization"))
        return findings + _speculative(cfg)
    findings += _memory(cfg, sc)
    findings += _budget(cfg, sc)
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
            {"max_model_len": pool_tokens}))
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
            {"max_num_seqs": max(1, fit)}))
    util = cfg.gpu_memory_utilization
    if util > MAX_GPU_MEMORY_UTILIZATION:
        out.append(Finding(
            "memory-utilization-high", "warning",
            f"gpu_memory_utilization {util} leaves {(1 - util) * sc.plan.memory_bytes / 2**30:.2f} GiB for everything "
            "outside the profiled forward (allocator fragmentation, other processes): out-of-memory risk",
            f"use at most {MAX_GPU_MEMORY_UTILIZATION}", {"gpu_memory_utilization": 0.9}))
    elif util < MIN_GPU_MEMORY_UTILIZATION:
        idle = (0.9 - util) * sc.plan.memory_bytes
        out.append(Finding(
            "memory-utilization-low", "warning",
            f"gpu_memory_utilization {util} leaves {idle / 2**30:.2f} GiB idle that at 0.9 would hold "
            f"{int(idle // sc.plan.kv_bytes_per_token):,} more KV tokens (pool now {pool_tokens:,})",
            "use --gpu-memory-utilization 0.9 unless another process shares the GPU",
            {"gpu_memory_utilization": 0.9}))
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
            {"enable_chunked_prefill": True}))
    if cfg.enable_chunked_prefill:
        cost = sc.cost
        # Decodes that ride along: as many as the pool holds at a typical 1k context.
        context = min(1024, mml)
        decodes = min(cfg.max_num_seqs, max(1, sc.plan.num_tokens // context))
        decode_s = cost.cost([(1, context)] * decodes, decodes).seconds
        limit = max(cfg.itl_target_ms / 1e3, STALL_FACTOR * decode_s)
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
                {"max_num_batched_tokens": good}))
    return out


def _blocks(cfg: ServeConfig) -> list[Finding]:
    bs = cfg.block_size
    out = []
    if bs > 32:
        out.append(Finding(
            "block-size-coarse", "warning",
            f"block_size {bs}: prefixes are shared only in whole blocks (a hit loses up to {bs - 1} tokens, "
            f"{(bs - 1) / 2:.0f} on average) and each sequence's last block wastes {(bs - 1) / 2:.0f} slots on average",
            "use --block-size 16 (or 32)", {"block_size": 16}))
    elif bs < 16:
        out.append(Finding(
            "block-size-fine", "info",
            f"block_size {bs}: {16 // bs}x the blocks of the default per sequence: longer block tables, more "
            "hashing and allocation work per token, for at most 7.5 fewer wasted slots per sequence",
            "use --block-size 16", {"block_size": 16}))
    if not cfg.enable_prefix_caching:
        out.append(Finding(
            "prefix-caching-off", "info",
            "prefix caching is off: shared system prompts and preempted requests are recomputed from scratch",
            "enable prefix caching (--enable-prefix-caching)", {"enable_prefix_caching": True}))
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


def quantify(cfg: ServeConfig, findings: list[Finding], requests, concurrency: int | None) -> None:
    """doctor --simulate: run the simulator before and after each finding's change."""
    from .simulator import simulate

    def run(c: ServeConfig) -> dict[str, float]:
        sc = scenario_for(c)
        policy = "chunked" if c.enable_chunked_prefill else "continuous"
        s = simulate(requests, sc.cost, sc.sim_config(policy, concurrency)).summary()
        return {k: round(s[k], 2) for k in ("output_throughput", "p99_itl_ms", "p99_ttft_ms", "num_preemptions")}

    try:
        before = run(cfg)
    except ValueError:
        return
    for f in findings:
        if not f.change or "speculative_config" in f.change:
            continue
        try:
            after = run(ServeConfig(**{**asdict(cfg), **f.change}))
        except ValueError as e:
            f.impact = {"error": str(e)}
            continue
        f.impact = {"before": before, "after": after}
