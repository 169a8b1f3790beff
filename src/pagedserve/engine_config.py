"""Engine configuration: one dataclass whose fields map 1:1 to CLI flags and to
`LLM(**options)`. Validation happens here, once, with errors naming the field."""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .attention.backend_names import TRITON_BACKEND
from .core.scheduler_config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    MIN_WHOLE_PROMPT_BUDGET,
    POLICIES,
    SCHEDULING_POLICIES,
    check_seats_fit_budget,
    chunks_prefill,
)
from .core.contiguous_kv import CONTIGUOUS_BACKENDS, KV_LAYOUTS
from .core.kv_connector import KVTransferConfig
from .core.kv_disk_index import KVOffloadConfig
from .core.kv_plan import KV_CACHE_DTYPES
from .core.request import POOLING_TYPES
from .core.step_budget import AUTO_ITL_RATIO, LatencyTarget
from .core.validation import require_int
from .kernels import KERNEL_CHOICES, resolve_kernels
from .model.config import GGUF_WEIGHTS, QUANTIZATION_CHOICES
from .model.device import CUDA_QUANTIZATION, DEVICE_CHOICES, DTYPE_CHOICES, resolve_dtype_name
from .resolved_config import (
    DeviceConfig,
    KVConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    ResolvedConfig,
    SchedulingConfig,
    ServingConfig,
    default_kv_cache_memory,
)
from .spec_decode.spec_config import SpeculativeConfig


def parse_memory(value: str | int | float) -> int:
    """Bytes from an int or a string like '2GiB', '512MB', '1.5G'."""
    if isinstance(value, (int, float)):
        return int(value)
    s = value.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "K": 2**10, "M": 2**20, "G": 2**30, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(float(s))

# mp: ranks this host spawns (distributed/worker.py); ray: Ray actors (distributed/ray_ranks.py).
EXECUTOR_BACKENDS = ("mp", "ray")
# "auto" is resolved by EngineConfig.resolve; load_model takes the rest.
ENGINE_QUANTIZATION = ("auto", *QUANTIZATION_CHOICES)
# What requests the engine takes: auto serves both, generate only generation, embed only
# pooling (/v1/embeddings, and /v1/score and /v1/rerank, which score by embeddings).
TASKS = ("auto", "generate", "embed")


def option(default: object, help: str, type: Callable[[str], object], choices: tuple[str, ...] | None = None,
           **cli: object) -> Any:
    """An EngineConfig field with its flag's help, `type` (what parses the flag's text; bool makes
    a --flag/--no-flag pair) and `choices`; `cli`: further argparse keywords (nargs, metavar)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices, "cli": cli})


@dataclass
class EngineConfig:
    """The options as given. `resolve` checks which go together and fills the defaults that
    depend on one another or on the device; the engine runs only a resolved config."""

    model: str | None = option(None, "a .gguf file or HF folder; default: the embedded SmolLM2-135M-Instruct", str)
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV-cache block", int)
    kv_cache_memory: int | None = option(
        None, "bytes for the KV cache (e.g. 2GiB); default: a share of free RAM", parse_memory)
    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "most requests running at once", int)
    max_num_batched_tokens: int | None = option(
        None, "a fixed token budget per step; default: chosen each step (a step beside decodes within "
              f"{AUTO_ITL_RATIO:g}x their decode-only time, at most {MIN_WHOLE_PROMPT_BUDGET} tokens) on cpu; "
              "a fixed budget on cuda (docs/gpu.md)", int)
    max_model_len: int | None = option(None, "context length limit; default: the model's", int)
    enable_prefix_caching: bool | None = option(
        None, "reuse KV of shared prompt prefixes (default: on with the paged layout, which alone can share)", bool)
    enable_chunked_prefill: bool = option(True, "split long prefills across steps", bool)
    long_prefill_token_threshold: int = option(0, "cap one prompt's tokens per step (0 = off)", int)
    scheduling_policy: str = option("fcfs", "fcfs or priority", str, SCHEDULING_POLICIES)
    policy: str = option("chunked", "scheduler study mode: " + ", ".join(POLICIES), str, POLICIES)
    attention_backend: str | None = option(
        None, "native (the default with native kernels), cpu (the default with torch kernels), triton (CUDA) "
              "or reference", str)
    kernels: str = option(
        "auto", "native: pagedserve's AVX2 op library; torch: pure torch; auto: native where the CPU and build allow",
        str, KERNEL_CHOICES)
    itl_target_ms: float | None = option(
        None, "choose each step's token budget to keep inter-token latency under this (chunked policy); "
              f"--max-num-batched-tokens is then the cap (default {MIN_WHOLE_PROMPT_BUDGET})", float)
    ttft_target_ms: float | None = option(
        None, "with a latency target: how long a step may take when no decode is running (default: up to the cap)",
        float)
    quantization: str = option(
        "auto", "linear-layer weights: auto (gguf for a GGUF file on the CPU's native kernels, as llama.cpp "
                "runs it; else none); none (--dtype; a GGUF's blocks multiplied in fp32, see --gguf-weights); "
                "q8_0, q4_0, q4_1 (llama.cpp blocks, quantised at load) or gguf (a GGUF's own blocks with int8 "
                "activations), CPU-only, on the native kernels; fp8 (e4m3 with per-channel scales, through "
                "torch._scaled_mm)", str, ENGINE_QUANTIZATION)
    gguf_weights: str = option(
        "auto", "with --quantization none, weights stored narrower than fp32 (a GGUF's blocks and F16/BF16 "
                "tensors, a bf16/f16 safetensors folder's matrices): blocks (read as stored and multiplied in fp32 "
                "by the native kernels: the same model at 1/6 to 1/2 of the bytes, fastest at small batches), "
                "dense (inflated to fp32 matrices for oneDNN, which can be faster at large batches on AVX-512) or "
                "auto (blocks, unless --dtype float32 asks for float32 weights)", str, GGUF_WEIGHTS)
    kv_cache_dtype: str = option(
        "auto", "KV cache elements: auto (fp16 beside a GGUF's int8 path, as llama.cpp; else the model's dtype), "
                "fp32, fp16 (half the bytes), fp8_e4m3 or fp8_e5m2 (a quarter); "
                "narrower ones are converted to fp32 as attention reads them", str, KV_CACHE_DTYPES)
    kv_layout: str = option(
        "paged", "paged: blocks from a preallocated pool; contiguous: one demand-paged virtual region per "
                 "request, committed by the OS as tokens arrive (no prefix caching, n > 1 or draft models)",
        str, KV_LAYOUTS)
    device: str = option("auto", "cpu, cuda, or auto (cuda when torch sees one); see docs/gpu.md", str, DEVICE_CHOICES)
    dtype: str = option(
        "auto", "weights and activations: auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16 (cuda)",
        str, DTYPE_CHOICES)
    enforce_eager: bool = option(False, "cuda: run decode steps eagerly, no CUDA graphs", bool)
    max_cudagraph_batch: int | None = option(
        None, "cuda: the largest decode batch captured in a CUDA graph (default min(max_num_seqs, 256))", int)
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "cuda: share of the device's memory for weights, activations and the KV pool (without --kv-cache-memory)",
        float)
    num_threads: int | None = option(
        None, "torch threads (per tensor-parallel rank); default: all cores, shared among a node's ranks", int)
    seed: int = option(0, "seed for requests that give none", int)
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
              'or \'{"method": "draft_model", "model": "self:8"}\'', str)
    tensor_parallel_size: int = option(
        1, "ranks the model's layers are split across, each in its own process (docs/tensor-parallel.md)", int)
    distributed_init_method: str | None = option(
        None, "where the ranks meet: tcp://host:port or env:// (MASTER_ADDR/MASTER_PORT); "
              "default: a free port on 127.0.0.1 (one node)", str)
    nnodes: int = option(1, "hosts the tensor-parallel ranks are spread over", int)
    node_rank: int = option(
        0, "this host's index among --nnodes (0 runs the engine; others run `pagedserve worker`)", int)
    distributed_executor_backend: str = option(
        "mp", "how the tensor-parallel ranks start: mp (processes this host spawns; other hosts run `pagedserve "
              "worker`) or ray (Ray actors placed by a placement group on the Ray cluster this process joins, "
              "RAY_ADDRESS or the local one; docs/scale-out.md)", str, EXECUTOR_BACKENDS)
    kv_transfer_config: KVTransferConfig | dict | str | None = option(
        None, 'disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "PagedServeConnector", '
              '"kv_role": "kv_producer", "kv_port": 14579, "lease_seconds": 30}\' (see docs/disaggregated.md)', str)
    kv_offload_dir: str | None = option(
        None, "a directory for a second tier of the prefix cache: full blocks of finished requests are written "
              "there and read back on a prefix miss; it persists across restarts and may be shared by replicas "
              "of the same model (docs/kv-disk-tier.md); needs --kv-offload-size", str)
    kv_offload_size: int | None = option(
        None, "the most bytes the disk tier keeps (e.g. 20GiB); least recently used files go first", parse_memory)
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT folders) beside the base model; a request's model names one", bool)
    lora_modules: dict[str, str] | list[str] | None = option(
        None, "adapters to load at start, as NAME=PATH (a folder with adapter_config.json and "
              "adapter_model.safetensors); needs --enable-lora", str, nargs="+", metavar="NAME=PATH")
    max_loras: int = option(4, "most LoRA adapters loaded at once", int)
    max_lora_rank: int = option(16, "largest LoRA rank an adapter may have", int)
    task: str = option(
        "auto", "requests served: auto (generation and embeddings on one engine), generate, or embed "
                "(/v1/embeddings, /v1/score, /v1/rerank)", str, TASKS)
    pooling_type: str = option(
        "last", "how an embedding pools the prompt's final hidden states: last (token, as decoder embedding "
                "models), mean, or cls (the first token); a request may choose its own", str, POOLING_TYPES)

    def __post_init__(self) -> None:
        """Each option on its own: parsed from its text form and checked against its choices or
        range. Which options go together is `resolve`'s."""
        for name in ("kv_cache_memory", "kv_offload_size"):
            if isinstance(getattr(self, name), str):
                try:
                    setattr(self, name, parse_memory(getattr(self, name)))
                except ValueError:
                    raise ValueError(f"{name} must be a size like 2GiB or 512MiB, got {getattr(self, name)!r}") \
                        from None
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        self.lora_modules = parse_lora_modules(self.lora_modules)
        for f in fields(self):
            choices = f.metadata["choices"]
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        for name in ("max_loras", "max_lora_rank", "tensor_parallel_size", "nnodes"):
            require_int(name, getattr(self, name), 1)
        require_int("node_rank", self.node_rank, 0)
        for name in ("kv_cache_memory", "kv_offload_size", "num_threads", "max_cudagraph_batch"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name), 1)
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("itl_target_ms", "ttft_target_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a number of milliseconds > 0, got {value!r}")
        method = self.distributed_init_method
        if method is not None and not (method.startswith("tcp://") or method == "env://"):
            raise ValueError(f"distributed_init_method must be tcp://host:port or env://, got {method!r}")

    def resolve(self, device: str, loaded_as: str | None = None, for_worker: bool = False) -> ResolvedConfig:
        """This config checked against every rule about which options go together, then
        split into the frozen parts the engine's modules take, with every default that
        follows from other options filled in: kernels, dtype, quantization, kv_cache_dtype
        and gguf_weights concrete, enable_prefix_caching set, and the step token budget
        decided (`_scheduling`). The one place those rules live (docs/configuration.md);
        nothing the engine builds re-decides or re-checks them.

        `device`: "cpu" or "cuda", what `self.device` resolved to (model/device.resolve_device_name).
        `loaded_as`: the quantization of a model the caller loaded; None when the engine loads it.
        `for_worker`: for `pagedserve worker`, which runs the ranks of a node other than 0.
        Raises ValueError naming the options that conflict, before anything is loaded."""
        if self.device not in ("auto", device) or device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} cannot run as {device!r}")
        self._check_parallel(device, loaded_as)
        self._check_node_role(for_worker)
        self._check_kv_layout(device)
        kv_offload = self._kv_offload()
        self._check_device(device)
        scheduling = self._scheduling(device)
        self._check_lora(device)
        self._check_task()
        kernels = "torch" if device == "cuda" else resolve_kernels(self.kernels)
        quantization = self._quantization(kernels, loaded_as)
        # fp16 KV costs nothing measured in accuracy (docs/benchmarks.md) and halves what
        # decode attention reads; llama.cpp stores f16 too. Beside fp32 weights "auto" stays
        # the model's dtype, so the fp32 path remains the exact oracle of transformers.
        kv_cache_dtype = "fp16" if self.kv_cache_dtype == "auto" and quantization == "gguf" else self.kv_cache_dtype
        # An explicit --dtype float32 holds every weight as an fp32 matrix: the exact oneDNN path.
        gguf_weights = self.gguf_weights if self.gguf_weights != "auto" else \
            "dense" if self.dtype == "float32" else "blocks"
        # On a GPU an unset pool is the device memory plan's (engine/device_memory.py).
        kv_cache_memory = self.kv_cache_memory or (default_kv_cache_memory() if device == "cpu" else None)
        prefix_caching = self.kv_layout == "paged" if self.enable_prefix_caching is None else self.enable_prefix_caching
        return ResolvedConfig(
            load=LoadConfig(self.model, quantization, gguf_weights, self.max_model_len),
            device=DeviceConfig(device, kernels, resolve_dtype_name(self.dtype, device), self.attention_backend,
                                self.enforce_eager, self.max_cudagraph_batch, self.gpu_memory_utilization),
            kv=KVConfig(self.block_size, kv_cache_memory, kv_cache_dtype, self.kv_layout, prefix_caching, kv_offload),
            scheduling=scheduling,
            parallel=ParallelConfig(self.tensor_parallel_size, self.nnodes, self.node_rank,
                                    self.distributed_init_method, self.distributed_executor_backend,
                                    self.num_threads),
            lora=LoRAConfig(self.enable_lora, tuple(self.lora_modules.items()), self.max_loras, self.max_lora_rank),
            serving=ServingConfig(self.task, self.pooling_type, self.seed, self.speculative_config,
                                  self.kv_transfer_config),
        )

    @classmethod
    def from_resolved(cls, resolved: ResolvedConfig) -> EngineConfig:
        """The options a resolved config holds, every default filled: resolving them again gives it back."""
        load, device, kv, scheduling = resolved.load, resolved.device, resolved.kv, resolved.scheduling
        parallel, lora, serving = resolved.parallel, resolved.lora, resolved.serving
        return cls(
            model=load.model, quantization=load.quantization, gguf_weights=load.gguf_weights,
            max_model_len=load.max_model_len, device=device.name, kernels=device.kernels, dtype=device.dtype,
            attention_backend=device.attention_backend, enforce_eager=device.enforce_eager,
            max_cudagraph_batch=device.max_cudagraph_batch, gpu_memory_utilization=device.gpu_memory_utilization,
            block_size=kv.block_size, kv_cache_memory=kv.kv_cache_memory, kv_cache_dtype=kv.kv_cache_dtype,
            kv_layout=kv.kv_layout, enable_prefix_caching=kv.enable_prefix_caching,
            kv_offload_dir=kv.offload.directory if kv.offload is not None else None,
            kv_offload_size=kv.offload.size if kv.offload is not None else None,
            max_num_seqs=scheduling.max_num_seqs, max_num_batched_tokens=scheduling.max_num_batched_tokens,
            itl_target_ms=scheduling.itl_target_ms, ttft_target_ms=scheduling.ttft_target_ms,
            enable_chunked_prefill=scheduling.enable_chunked_prefill,
            long_prefill_token_threshold=scheduling.long_prefill_token_threshold,
            scheduling_policy=scheduling.scheduling_policy, policy=scheduling.policy,
            tensor_parallel_size=parallel.tensor_parallel_size, nnodes=parallel.nnodes, node_rank=parallel.node_rank,
            distributed_init_method=parallel.distributed_init_method,
            distributed_executor_backend=parallel.distributed_executor_backend, num_threads=parallel.num_threads,
            enable_lora=lora.enable_lora, lora_modules=dict(lora.lora_modules), max_loras=lora.max_loras,
            max_lora_rank=lora.max_lora_rank, task=serving.task, pooling_type=serving.pooling_type, seed=serving.seed,
            speculative_config=serving.speculative_config, kv_transfer_config=serving.kv_transfer_config)

    def _check_task(self) -> None:
        if self.task != "embed":
            return
        # An embedding engine never decodes: nothing to speculate, no KV to hand a decoder.
        if self.speculative_config is not None:
            raise ValueError("task 'embed' never decodes: speculative_config has nothing to speculate")
        if self.kv_transfer_config is not None:
            raise ValueError("task 'embed' never decodes: kv_transfer_config has no decode instance to feed")

    def _check_parallel(self, device: str, loaded_as: str | None) -> None:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                             f"nnodes ({self.nnodes}): every node runs as many ranks")
        if self.nnodes > 1 and not self.distributed_init_method:
            raise ValueError("nnodes > 1 needs distributed_init_method (tcp://HOST:PORT of node 0, or env://)")
        self._check_ray_executor()
        if self.tensor_parallel_size == 1:
            return
        if device == "cuda":
            raise ValueError("tensor_parallel_size > 1 runs on the CPU (gloo) only; use device='cpu'")
        if loaded_as is not None:
            raise ValueError("tensor_parallel_size > 1 loads each rank's shard itself; pass no loaded model")
        if self.speculative_config is not None:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")
        if self.quantization not in ("auto", "none"):
            raise ValueError(f"quantization={self.quantization!r} is not supported with tensor_parallel_size > 1 "
                             "(the shards are fp32; use quantization='none')")
        if self.kv_transfer_config is not None:
            # The connector moves one rank's cache; the other ranks' shards would stay behind.
            raise ValueError("kv_transfer_config is not supported with tensor_parallel_size > 1")
        if self.enable_lora:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 (the adapters are not sharded)")

    def _check_node_role(self, for_worker: bool) -> None:
        if for_worker and (self.nnodes < 2 or self.node_rank < 1):
            raise ValueError("pagedserve worker runs the ranks of nodes 1 .. nnodes-1: give --nnodes >= 2 and "
                             "--node-rank >= 1 (node 0 runs `pagedserve serve` or `generate`)")
        if not for_worker and self.node_rank != 0:
            raise ValueError("the engine runs on node 0 (node_rank 0); start the ranks of other nodes with "
                             "`pagedserve worker --node-rank R ...`")

    def _check_ray_executor(self) -> None:
        if self.distributed_executor_backend != "ray":
            return
        # The placement group decides where every rank runs and rank 0's node hands out the
        # rendezvous address: the mp backend's hand-placed nodes have no meaning there.
        if self.nnodes > 1 or self.node_rank:
            raise ValueError("distributed_executor_backend='ray' places the ranks itself: leave nnodes and "
                             "node_rank at their defaults (they place mp ranks by hand)")
        if self.distributed_init_method:
            raise ValueError("distributed_executor_backend='ray' sets the rendezvous address from rank 0's node: "
                             "give no distributed_init_method")
        if self.tensor_parallel_size == 1:
            raise ValueError("distributed_executor_backend='ray' starts tensor_parallel_size - 1 rank actors; "
                             "with tensor_parallel_size 1 there are none (use the Ray Serve app for replicas)")

    def _check_kv_layout(self, device: str) -> None:
        if self.kv_layout == "paged":
            if self.attention_backend in CONTIGUOUS_BACKENDS:
                raise ValueError(f"attention_backend {self.attention_backend!r} needs kv_layout='contiguous'")
            return
        # Sharing a prefix or a forked prompt means mapping the same pages into several
        # regions; docs/kv-layouts.md says why that is left to the paged layout.
        if self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching needs kv_layout='paged': the contiguous layout shares no pages")
        if device == "cuda":
            raise ValueError("kv_layout='contiguous' maps host memory; use kv_layout='paged' on device='cuda'")
        # Its regions live in this process's address space, read by this process's attention.
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_layout='contiguous' is not supported with tensor_parallel_size > 1")
        if self.kv_transfer_config is not None:
            raise ValueError("kv_layout='contiguous' is not supported with kv_transfer_config")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("speculative_config method 'draft_model' needs kv_layout='paged' (its scratch blocks "
                             "are paged); use method 'ngram' with the contiguous layout")

    def _kv_offload(self) -> KVOffloadConfig | None:
        """The disk tier: a second level of the paged prefix cache, written and read as a KV connector."""
        if self.kv_offload_dir is None:
            if self.kv_offload_size is not None:
                raise ValueError("kv_offload_size needs kv_offload_dir")
            return None
        if self.kv_offload_size is None:
            raise ValueError("kv_offload_dir needs kv_offload_size (e.g. 20GiB)")
        if self.kv_layout != "paged":
            raise ValueError("kv_offload_dir needs kv_layout='paged': the disk tier stores prefix-cache blocks, "
                             "and the contiguous layout has none")
        if self.enable_prefix_caching is False:
            raise ValueError("kv_offload_dir needs enable_prefix_caching: the disk tier is the prefix cache's "
                             "second level")
        if self.kv_transfer_config is not None:
            raise ValueError("kv_offload_dir is not supported with kv_transfer_config (one KV connector per engine)")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_offload_dir is not supported with tensor_parallel_size > 1 (each rank holds a "
                             "share of every block)")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("kv_offload_dir is not supported with speculative_config method 'draft_model' (the "
                             "tier stores the target's KV only); use method 'ngram'")
        return KVOffloadConfig(self.kv_offload_dir, self.kv_offload_size)

    def _check_device(self, device: str) -> None:
        if self.quantization not in ("auto", "none", "fp8") and self.kernels == "torch":
            raise ValueError(f"quantization={self.quantization!r} runs on the native kernels; kernels='torch' has none")
        if device == "cpu":
            if self.dtype not in ("auto", "float32"):
                raise ValueError(f"dtype={self.dtype!r} runs on cuda only; on device='cpu' the model computes in float32")
            return
        if self.quantization not in CUDA_QUANTIZATION:
            raise ValueError(f"quantization={self.quantization!r} runs on pagedserve's CPU kernels only; "
                             f"on device='cuda' use one of {', '.join(CUDA_QUANTIZATION)}")
        if self.kernels == "native":
            raise ValueError("kernels='native' is pagedserve's CPU op library; on device='cuda' use kernels='auto' "
                             "or 'torch'")
        if self.attention_backend not in (None, TRITON_BACKEND):
            raise ValueError(f"attention_backend={self.attention_backend!r} runs on cpu; on device='cuda' use "
                             f"{TRITON_BACKEND!r} (the default there)")
        spec = self.speculative_config
        # Also why decode graphs never meet a draft model (worker/model_runner.py).
        if spec is not None and spec.method != "ngram":
            raise ValueError("speculative_config with a draft model runs on cpu only; on device='cuda' use "
                             "method 'ngram'")

    def _scheduling(self, device: str) -> SchedulingConfig:
        """The scheduling rules, then the step token budget, decided here once: a fixed
        budget (given, or cuda's), else a latency target (given, or the automatic one for
        chunked prefill) under a cap, else (policies that never chunk) a whole prompt."""
        chunked = chunks_prefill(self.policy, self.enable_chunked_prefill)
        if self.has_latency_target:
            check_latency_target_policy(self.policy, self.enable_chunked_prefill)
        if self.kv_transfer_config is not None and self.policy not in ("chunked", "continuous"):
            raise ValueError(f"kv_transfer_config needs policy 'chunked' or 'continuous', got {self.policy!r}")
        fixed = self.max_num_batched_tokens
        # On cuda a step's weight reads are cheap beside its tokens: vLLM's fixed budget, no automatic target.
        if device == "cuda" and fixed is None and not self.has_latency_target and chunked:
            fixed = GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
        target = None
        if self.has_latency_target:
            target = LatencyTarget(_ms_to_s(self.itl_target_ms), _ms_to_s(self.ttft_target_ms))
        elif fixed is None and chunked:
            # A step beside decodes within AUTO_ITL_RATIO of their decode-only time.
            target = LatencyTarget(itl_ratio=AUTO_ITL_RATIO)
        # The target sizes steps; its cap only has to let a wave of prompts into one (vLLM's 2,048).
        cap = fixed or (MIN_WHOLE_PROMPT_BUDGET if target is not None else None)
        if cap is not None:
            check_seats_fit_budget(self.max_num_seqs, cap)
        return SchedulingConfig(self.max_num_seqs, fixed, cap, target, self.itl_target_ms, self.ttft_target_ms,
                                self.enable_chunked_prefill, self.long_prefill_token_threshold,
                                self.scheduling_policy, self.policy)

    def _check_lora(self, device: str) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"lora_modules names {len(self.lora_modules)} adapters; max_loras is {self.max_loras}")
        if self.enable_lora and device == "cuda":
            raise ValueError("enable_lora runs on the CPU only so far (the adapter stacks live in host memory); "
                             "device is 'cuda'")

    def _quantization(self, kernels: str, loaded_as: str | None) -> str:
        """"auto": a GGUF file's own blocks with int8 activations where the native kernels run
        them on one rank, as llama.cpp runs the file (perplexity within 0.3% of fp32 on the
        blocks, docs/benchmarks.md); a model the caller loaded as it was loaded; otherwise the
        weights as --dtype."""
        if self.quantization != "auto":
            return self.quantization
        if loaded_as is not None:
            return loaded_as
        if kernels != "native" or self.tensor_parallel_size > 1:
            return "none"
        from .model.sources import resolve_model  # here: it reads the tokenizer library, which a config need not

        return "gguf" if resolve_model(self.model).kind == "gguf" else "none"

    @property
    def has_latency_target(self) -> bool:
        """Whether the user gave an ITL or TTFT target."""
        return self.itl_target_ms is not None or self.ttft_target_ms is not None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, typed, constrained and explained by the field's own metadata (`option`)."""
        for f in fields(cls):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            if meta["type"] is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
            else:
                parser.add_argument(flag, type=meta["type"], choices=meta["choices"], default=f.default,
                                    help=meta["help"], **meta["cli"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def check_latency_target_policy(policy: str, enable_chunked_prefill: bool) -> None:
    """A latency target sizes each step's chunks of prompts: only chunked prefill has chunks.
    `resolve`'s rule, which the simulator's configs apply to their targets too."""
    if not chunks_prefill(policy, enable_chunked_prefill):
        raise ValueError("itl_target_ms and ttft_target_ms need chunked prefill (policy 'chunked' with "
                         f"enable_chunked_prefill); policy is {policy!r}, enable_chunked_prefill "
                         f"{enable_chunked_prefill}")


def parse_lora_modules(modules: dict[str, str] | list[str] | None) -> dict[str, str]:
    """{name: path} from a dict or from NAME=PATH strings (the CLI's form)."""
    if modules is None:
        return {}
    if isinstance(modules, dict):
        items = list(modules.items())
    elif isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
        items = [m.partition("=")[::2] for m in modules]
    else:
        raise ValueError(f"lora_modules must be a dict of name -> path or a list of NAME=PATH, got {modules!r}")
    out: dict[str, str] = {}
    for name, path in items:
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"lora_modules entries must be NAME=PATH with both parts non-empty, got {name!r}={path!r}")
        if name in out:
            raise ValueError(f"lora_modules names {name!r} twice")
        out[name] = path
    return out


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
