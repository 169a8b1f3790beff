"""The engine's parts wired from a resolved config: `WIRING` is the table of which part is
built from which parts of the config and which parts built before it, in build order.

Each row's function takes the config parts it names, then the built parts it names, in
that order, and returns its part (or, for a row that provides two names, a pair). Nothing
here decides an option: `EngineConfig.resolve` did (docs/configuration.md).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.selector import default_backend_name
from ..core.kv_connector import KVConnectorScheduler
from ..core.kv_disk_index import DiskIndex
from ..core.kv_disk_tier import DiskTierScheduler
from ..core.kv_plan import KVCachePlan, plan_kv_cache
from ..core.pd_connector import PagedServeConnectorScheduler
from ..core.scheduler import Scheduler
from ..core.scheduler_config import CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS, CacheConfig, SchedulerConfig
from ..core.step_budget import PromptSupply, StepBudget
from ..distributed.executor import TensorParallelExecutor
from ..kv_transfer.base import KVConnectorWorker
from ..kv_transfer.disk_tier_worker import DiskTierWorker
from ..kv_transfer.factory import make_kv_connector_worker
from ..model.device import torch_dtype
from ..model.loader import LoadedModel
from ..model.lora import LoRASlots
from ..model.device_placement import place_model
from ..resolved_config import DeviceConfig, KVConfig, LoadConfig, LoRAConfig, ResolvedConfig, SchedulingConfig, \
    ServingConfig
from ..spec_decode.acceptance_stats import SpecDecodeStats
from ..structured_output.manager import StructuredOutputManager
from ..core.contiguous_kv import ContiguousKVCacheManager
from ..worker.contiguous_kv_memory import ContiguousKVStore, build_contiguous_kv
from ..worker.draft_model import draft_kv, load_draft
from ..worker.image_embeds import ImageEmbedder
from ..worker.model_runner import ModelRunner
from .device_memory import device_memory_plan, kv_dtype_bytes
from .kv_offload_key import offload_namespace
from .lora_registry import LoRARegistry
from .step_timing import step_time_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """`provides` is built by `build(*config parts named in reads, *parts named in needs)`."""

    provides: tuple[str, ...]
    reads: tuple[str, ...]
    needs: tuple[str, ...]
    build: Callable[..., object]


def _max_model_len(load: LoadConfig, loaded: LoadedModel) -> int:
    return load.context_length(loaded.config.max_position_embeddings)


def _model(device: DeviceConfig, load: LoadConfig, loaded: LoadedModel, max_model_len: int,
           keeps_loaded_model: bool) -> torch.nn.Module:
    """The target model on its kernels, placed on the device unless used as loaded."""
    loaded.model.set_kernels(device.kernels)
    if not keeps_loaded_model:
        place_model(loaded.model, torch.device(device.name), torch_dtype(device.dtype), load.quantization,
                    max_positions=max_model_len)
    return loaded.model


def _images(device: DeviceConfig, loaded: LoadedModel) -> ImageEmbedder | None:
    """A vision model's encoder, on the text decoder's device (in float32: its output is cast
    to the decoder's dtype where it replaces token embeddings); None for a text-only model."""
    if loaded.vision is None:
        return None
    return ImageEmbedder(loaded.vision.to(torch.device(device.name)), loaded.image_prompts.image_token_id)


def _draft(serving: ServingConfig, device: DeviceConfig, loaded: LoadedModel, model: torch.nn.Module) \
        -> LoadedModel | None:
    # `model` is in the row so that the draft is made from the target as placed.
    return load_draft(loaded, serving.speculative_config, device.kernels)


def _kv_pool_bytes(config: ResolvedConfig, loaded: LoadedModel, scheduler_config: SchedulerConfig) -> int | None:
    """On a GPU the device memory plan's pool; on the CPU None (kv_cache_memory sizes it)."""
    if not config.device.on_gpu:
        return None
    total = torch.cuda.mem_get_info(torch.device(config.device.name))[1]
    return device_memory_plan(config, loaded.config, total, scheduler_config.max_num_batched_tokens).kv_pool_bytes


def _kv_plan(kv: KVConfig, device: DeviceConfig, serving: ServingConfig, scheduling: SchedulingConfig,
             model: torch.nn.Module, draft: LoadedModel | None, pool: int | None) -> KVCachePlan:
    """The pool that kv_cache_memory (or the device plan's `pool`) holds beside the draft's
    scratch; ValueError if not one block. The model's own config is a rank's share under
    tensor parallelism."""
    memory = pool or kv.kv_cache_memory
    width = kv_dtype_bytes(kv.kv_cache_dtype, device.dtype)
    target = model.config
    scratch = (draft_kv(serving.speculative_config, draft.config, target, scheduling.max_num_seqs, width)
               if draft is not None else None)
    plan = plan_kv_cache(memory, kv.block_size, target.kv_bytes_per_token(width), scratch)
    if plan.num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({memory} bytes) is below one KV block ({plan.bytes_per_block} bytes)"
                         + (f" plus {plan.scratch_bytes} bytes of draft scratch" if plan.scratch_bytes else ""))
    return plan


def _peers(kv: KVConfig, device: DeviceConfig, tp: TensorParallelExecutor | None, kv_plan: KVCachePlan) \
        -> TensorParallelExecutor | None:
    """The tensor-parallel ranks, told the pool's size (None without tensor parallelism)."""
    if tp is not None:
        tp.start(kv_plan.num_blocks, kv.block_size, kv.kv_cache_dtype, device.kernels)
    return tp


def _lora_slots(lora: LoRAConfig, device: DeviceConfig, loaded: LoadedModel) -> LoRASlots | None:
    if not lora.enable_lora:
        return None
    return LoRASlots(loaded.config, lora.max_loras, lora.max_lora_rank, native=device.kernels == "native")


def _contiguous_kv(kv: KVConfig, scheduling: SchedulingConfig, loaded: LoadedModel, cache_config: CacheConfig,
                   max_model_len: int) -> tuple[ContiguousKVStore | None, ContiguousKVCacheManager | None]:
    """The contiguous layout: a demand-paged mapping (runner) and its page accounting (scheduler)."""
    if kv.kv_layout != "contiguous":
        return None, None
    return build_contiguous_kv(loaded.config, cache_config, kv.kv_cache_memory, max_model_len,
                               scheduling.max_num_seqs, kv.kv_cache_dtype)


def _kv_connector(config: ResolvedConfig, loaded: LoadedModel) \
        -> tuple[KVConnectorWorker | None, KVConnectorScheduler | None]:
    """The disaggregated-prefill connector's or the disk tier's worker and scheduler sides, or neither."""
    kv = config.kv
    if kv.offload is not None:
        namespace = offload_namespace(config, loaded)
        index = DiskIndex(kv.offload.directory, kv.offload.size)
        return DiskTierWorker(index, namespace), DiskTierScheduler(kv.offload, index, namespace, kv.block_size)
    kv_transfer = config.serving.kv_transfer_config
    if kv_transfer is None:
        return None, None
    worker = make_kv_connector_worker(kv_transfer)
    return worker, PagedServeConnectorScheduler(kv_transfer, kv.block_size, worker.engine_id, worker.host,
                                                worker.port)


def _step_budget(scheduling: SchedulingConfig, loaded: LoadedModel, scheduler_config: SchedulerConfig) \
        -> StepBudget | None:
    """The latency target's per-step budget (None: the fixed max_num_batched_tokens)."""
    target = scheduling.latency_target
    if target is None:
        return None
    cap = scheduler_config.max_num_batched_tokens
    model, source = step_time_model(loaded.config)
    if target.itl_ratio is not None:
        logger.info("step budget: automatic, a step beside decodes within %.1fx their decode-only time "
                    "(cap %d tokens); step times from %s", target.itl_ratio, cap, source)
    else:
        logger.info("latency target itl %s ms, ttft %s ms (cap %d tokens); step times from %s",
                    scheduling.itl_target_ms, scheduling.ttft_target_ms, cap, source)
    return StepBudget(model, target, cap, supply=PromptSupply(CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS))


def _runner(device: DeviceConfig, kv: KVConfig, serving: ServingConfig, model: torch.nn.Module,
            loaded: LoadedModel, kv_plan: KVCachePlan, scheduler_config: SchedulerConfig,
            draft: LoadedModel | None, peers: TensorParallelExecutor | None,
            kv_connector: KVConnectorWorker | None, kv_store: ContiguousKVStore | None,
            lora_slots: LoRASlots | None, images: ImageEmbedder | None) -> ModelRunner:
    backend = default_backend_name(device.kernels, device.name, kv.kv_layout)
    return ModelRunner(
        model, kv_plan, scheduler_config.max_num_seqs, scheduler_config.max_model_len,
        eos_token_ids=tuple(loaded.tokenizer.stop_token_ids), attention_backend=device.attention_backend or backend,
        speculative=serving.speculative_config, draft=draft.model if draft is not None else None,
        kv_cache_dtype=kv.kv_cache_dtype, peers=peers, kv_connector=kv_connector, device=torch.device(device.name),
        decode_graphs=device.decode_graphs, max_cudagraph_batch=device.max_cudagraph_batch,
        model_dtype=torch_dtype(device.dtype), kv_caches=kv_store.kv_caches if kv_store is not None else None,
        lora_slots=lora_slots, images=images,
    )


def _loras(lora_slots: LoRASlots | None, loaded: LoadedModel) -> LoRARegistry | None:
    return LoRARegistry(lora_slots, loaded.config) if lora_slots is not None else None


def _spec_stats(serving: ServingConfig) -> SpecDecodeStats | None:
    spec = serving.speculative_config
    return SpecDecodeStats(spec.num_speculative_tokens) if spec is not None else None


def _structured_outputs(loaded: LoadedModel) -> StructuredOutputManager:
    return StructuredOutputManager(loaded.tokenizer, loaded.config.vocab_size)


# provides, config parts read ("config": the whole of it), parts needed (given: loaded, tp,
# keeps_loaded_model), function
WIRING: tuple[Row, ...] = (
    Row(("max_model_len",), ("load",), ("loaded",), _max_model_len),
    Row(("model",), ("device", "load"), ("loaded", "max_model_len", "keeps_loaded_model"), _model),
    Row(("images",), ("device",), ("loaded",), _images),
    Row(("draft",), ("serving", "device"), ("loaded", "model"), _draft),
    Row(("scheduler_config",), ("scheduling",), ("max_model_len",), SchedulingConfig.scheduler_config),
    Row(("kv_pool_bytes",), ("config",), ("loaded", "scheduler_config"), _kv_pool_bytes),
    Row(("kv_plan",), ("kv", "device", "serving", "scheduling"), ("model", "draft", "kv_pool_bytes"), _kv_plan),
    Row(("peers",), ("kv", "device"), ("tp", "kv_plan"), _peers),
    Row(("lora_slots",), ("lora", "device"), ("loaded",), _lora_slots),
    Row(("cache_config",), ("kv",), ("kv_plan",), lambda kv, plan: kv.cache_config(plan.num_blocks)),
    Row(("kv_store", "kv_manager"), ("kv", "scheduling"), ("loaded", "cache_config", "max_model_len"), _contiguous_kv),
    Row(("kv_connector", "connector_scheduler"), ("config",), ("loaded",), _kv_connector),
    Row(("step_budget",), ("scheduling",), ("loaded", "scheduler_config"), _step_budget),
    Row(("scheduler",), (), ("scheduler_config", "cache_config", "step_budget", "connector_scheduler", "kv_manager"),
        lambda sched, cache, budget, connector, kv: Scheduler(sched, cache, budget, connector, kv_cache=kv)),
    Row(("runner",), ("device", "kv", "serving"),
        ("model", "loaded", "kv_plan", "scheduler_config", "draft", "peers", "kv_connector", "kv_store", "lora_slots",
         "images"),
        _runner),
    Row(("loras",), (), ("lora_slots", "loaded"), _loras),
    Row(("spec_stats",), ("serving",), (), _spec_stats),
    Row(("structured_outputs",), (), ("loaded",), _structured_outputs),
)


def build_parts(config: ResolvedConfig, parts: dict[str, object]) -> dict[str, object]:
    """Build every row of WIRING into `parts` (which holds the given ones), in order; `parts`
    keeps what was built when a row fails, for the caller to shut down."""
    for row in WIRING:
        reads = [config if name == "config" else getattr(config, name) for name in row.reads]
        made = row.build(*reads, *(parts[name] for name in row.needs))
        parts.update(zip(row.provides, made if len(row.provides) > 1 else (made,)))
    return parts
