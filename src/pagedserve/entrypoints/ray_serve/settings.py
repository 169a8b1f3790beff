"""The Ray Serve app's one YAML file (`pagedserve serve-ray CONFIG.yaml`):

    engine:            # EngineConfig fields, as `pagedserve serve`'s engine flags (underscores)
      kv_cache_memory: 512MiB
      num_threads: 1
    server:            # `pagedserve serve`'s server options but host/port (every replica's)
      served_model_name: [smollm2]
    replicas:
      num_replicas: 2              # fixed; with max_replicas: autoscaled from min_replicas
      max_replicas: 4              # (start at num_replicas) on ongoing requests per replica
      target_ongoing_requests: 4
      max_ongoing_requests: 32     # per replica; more wait in the handle's queue
      num_cpus: 1                  # per replica (default: engine.num_threads or 1)
    router:
      policy: cache_aware          # round_robin, least_load or cache_aware (router/routing_policies.py)
      cache_load_weight: 16
      balance_abs_threshold: 4
      balance_rel_threshold: 1.5
      routed_ttl_s: 30
      stats_period_s: 1            # how often each replica reports its cached block hashes
    http: {host: 127.0.0.1, port: 8000}
    disaggregated:     # optional: prefill and decode as two deployments, KV between them
      prefill_replicas: 1
      decode_replicas: 1

Every key is checked here; a misspelt one is an error, not a silent default."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ...core.scheduler_config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ...engine_config import EngineConfig
from ...model.config import ModelConfig
from ...router.routing_policies import POLICIES, CacheAwareConfig
from ...workload.datasets import BenchRequest
from ..openai.args import ServerConfig

if TYPE_CHECKING:
    from ...sim.cluster import ClusterSetup

_DEFAULT = CacheAwareConfig()


@dataclass(frozen=True)
class ReplicaSettings:
    num_replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    max_ongoing_requests: int = 32
    num_cpus: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_replicas", "min_replicas", "max_ongoing_requests"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"replicas.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_replicas is not None and not self.min_replicas <= self.num_replicas <= self.max_replicas:
            raise ValueError(f"replicas: need min_replicas <= num_replicas <= max_replicas, got {self.min_replicas}, "
                             f"{self.num_replicas}, {self.max_replicas}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"replicas.target_ongoing_requests must be > 0, got {self.target_ongoing_requests!r}")
        if self.num_cpus is not None and not self.num_cpus > 0:
            raise ValueError(f"replicas.num_cpus must be > 0, got {self.num_cpus!r}")

    def deployment_options(self, engine: EngineConfig, num_replicas: int | None = None) -> dict[str, Any]:
        """serve.deployment options: a fixed count (`num_replicas` overrides it: P/D's
        deployments), or autoscaling on ongoing requests."""
        options: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                                   "ray_actor_options": {"num_cpus": self.num_cpus or engine.num_threads or 1}}
        if num_replicas is not None or self.max_replicas is None:
            return {**options, "num_replicas": num_replicas or self.num_replicas}
        return {**options, "autoscaling_config": {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "initial_replicas": self.num_replicas, "target_ongoing_requests": self.target_ongoing_requests}}


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "cache_aware"
    cache_load_weight: float = _DEFAULT.load_weight
    balance_abs_threshold: int = _DEFAULT.balance_abs
    balance_rel_threshold: float = _DEFAULT.balance_rel
    routed_ttl_s: float = 30.0
    stats_period_s: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.cache()  # its own checks
        for name in ("routed_ttl_s", "stats_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"router.{name} must be > 0 seconds, got {getattr(self, name)!r}")

    def cache(self) -> CacheAwareConfig:
        return CacheAwareConfig(self.cache_load_weight, self.balance_abs_threshold, self.balance_rel_threshold)


@dataclass(frozen=True)
class DisaggregatedSettings:
    """Prefill and decode as two deployments (docs/disaggregated.md's P/D with the
    PagedServeConnector between them); `replicas` then gives their other options."""

    prefill_replicas: int = 1
    decode_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill_replicas", "decode_replicas"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"disaggregated.{name} must be an integer >= 1, got {getattr(self, name)!r}")

    @staticmethod
    def engine(engine: EngineConfig, role: str) -> EngineConfig:
        """Every replica's engine, as a KV producer (prefill) or consumer (decode)."""
        return dataclasses.replace(engine, kv_transfer_config={"kv_connector": "PagedServeConnector", "kv_role": role})


@dataclass(frozen=True)
class RayServeConfig:
    server: ServerConfig = field(default_factory=ServerConfig)  # .engine: every replica's engine
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    disaggregated: DisaggregatedSettings | None = None

    def __post_init__(self) -> None:
        if self.disaggregated is not None and self.server.engine.kv_transfer_config is not None:
            raise ValueError("disaggregated sets each deployment's engine.kv_transfer_config; give none")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RayServeConfig":
        _known("the config", raw, ("engine", "server", "replicas", "router", "http", "disaggregated"))
        server = dict(raw.get("server") or {})
        _known("server", server, [f.name for f in dataclasses.fields(ServerConfig)
                                  if f.name not in ("engine", "host", "port")])
        http = dict(raw.get("http") or {})
        _known("http", http, ("host", "port"))
        engine = EngineConfig(**_section(raw, "engine", [f.name for f in dataclasses.fields(EngineConfig)]))
        disaggregated = None
        if "disaggregated" in raw:
            disaggregated = DisaggregatedSettings(**_section(
                raw, "disaggregated", [f.name for f in dataclasses.fields(DisaggregatedSettings)]))
        return cls(ServerConfig(engine=engine, **server, **http),
                   ReplicaSettings(**_section(raw, "replicas", [f.name for f in dataclasses.fields(ReplicaSettings)])),
                   RouterSettings(**_section(raw, "router", [f.name for f in dataclasses.fields(RouterSettings)])),
                   disaggregated)

    @classmethod
    def load(cls, path: str | Path) -> "RayServeConfig":
        """The file's config; ValueError naming the file for one that cannot be read, is not
        YAML, or has a bad section or key."""
        try:
            with open(path) as f:
                raw = yaml.safe_load(f)  # its errors name the file, line and column
        except OSError as e:
            raise ValueError(f"{path}: cannot read the config: {e.strerror or e}") from e
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a YAML mapping with engine/server/replicas/router/http sections is expected")
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e


def _section(raw: dict[str, Any], name: str, allowed: list[str]) -> dict[str, Any]:
    section = raw.get(name) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{name} must be a mapping, got {section!r}")
    _known(name, section, allowed)
    return section


def _known(where: str, section: dict[str, Any], allowed) -> None:
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")


# A replica's process beside its weights and KV pool: torch, the tokenizer, the server, Ray's worker.
REPLICA_RUNTIME_BYTES = 1 << 30


def replica_memory_bytes(config: RayServeConfig, model: ModelConfig) -> int:
    """What one replica of `model` needs: fp32 weights (the CPU path), the KV pool
    (engine.kv_cache_memory, which a deployment should set) and the runtime beside them."""
    if config.server.engine.kv_cache_memory is None:
        raise ValueError("engine.kv_cache_memory: give the replicas' KV pool size to size their memory")
    return model.num_params * 4 + config.server.engine.kv_cache_memory + REPLICA_RUNTIME_BYTES


# The engine's resolved element types priced by the simulator's (sim/cost_model.py DTYPES)
# of the same width; a KV cache of the model's dtype ("auto") is the simulator's default too.
_SIM_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}
_SIM_KV_DTYPE = {"fp32": "fp32", "fp16": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def cluster_setup(config: RayServeConfig, model: str, hardware: str, seed: int = 0) -> "ClusterSetup":
    """The cluster simulator's instance setup for this app's replicas on `hardware`: its
    router policy, and each replica's engine options (engine section) resolved for the
    hardware's device (EngineConfig.resolve: cpu for cpu-local, else cuda) as the
    scheduler's limits and the KV pool (block_size, kv_cache_memory or
    gpu_memory_utilization, prefix caching, dtypes). A budget resolve leaves to a latency
    target, which the cluster simulator does not model, is priced as the chunked policy's
    fixed default."""
    from ...sim.cluster import ClusterSetup
    from ...sim.hardware import CPU_LOCAL

    if config.disaggregated is not None:
        raise ValueError("predict models colocated replicas; drop the disaggregated section")
    resolved = config.server.engine.resolve("cpu" if hardware == CPU_LOCAL else "cuda")
    kv, scheduling = resolved.kv, resolved.scheduling
    return ClusterSetup(model, hardware, _SIM_DTYPE[resolved.device.dtype], _SIM_KV_DTYPE.get(kv.kv_cache_dtype),
                        max_num_seqs=scheduling.max_num_seqs,
                        max_num_batched_tokens=scheduling.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        max_model_len=resolved.load.max_model_len, seed=seed, block_size=kv.block_size,
                        kv_cache_memory=kv.kv_cache_memory,
                        gpu_memory_utilization=resolved.device.gpu_memory_utilization,
                        enable_prefix_caching=kv.enable_prefix_caching,
                        policy=config.router.policy, cache=config.router.cache())


def predict(config: RayServeConfig, requests: list[BenchRequest], model: str, hardware: str,
            request_rate: float, seed: int = 0) -> list[dict[str, float]]:
    """What `sim cluster` predicts for this app (`pagedserve sim cluster --ray-config`): its
    replicas (autoscaling's initial count) as colocated instances set up by `cluster_setup`,
    `requests` arriving Poisson at `request_rate` (inf: all at once), drawn with `seed`.
    Lives here, not in sim/, because sim/ sits below entrypoints/ and must not read this
    file's types. Returns one row per replica: the requests routed to it, its prefix-cache
    hit rate (hit tokens / looked-up tokens), and its requests' output throughput over the
    run, TTFT and TPOT (NaN for a replica that got none)."""
    from ...sim.cluster import Layout, simulate_cluster
    from ...workload.serving_stats import summarize

    n = config.replicas.num_replicas
    setup = cluster_setup(config, model, hardware, seed)
    result = simulate_cluster(requests, Layout(f"{n}r", num_replicas=n), setup, request_rate)
    rows = []
    for k, sched in enumerate(result.schedulers):
        c = sched.kv_cache
        s = summarize(result.replica_records(k), result.duration, percentiles=(90,))
        rows.append({"replica": k, "requests": s["completed"],
                     "hit_rate": c.prefix_cache_hits / max(c.prefix_cache_queries, 1),
                     "output_throughput": s["output_throughput"], "mean_ttft_ms": s["mean_ttft_ms"],
                     "p90_ttft_ms": s["p90_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"]})
    return rows
