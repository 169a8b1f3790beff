"""Engine configuration: one dataclass whose fields map 1:1 to CLI flags and to
`LLM(**options)`. Validation happens here, once, with errors naming the field."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields

from .core.config import (
    MIN_WHOLE_PROMPT_BUDGET,
    POLICIES,
    SCHEDULING_POLICIES,
    CacheConfig,
    SchedulerConfig,
    chunks_prefill,
    whole_prompt_budget,
)
from .core.contiguous_kv import CONTIGUOUS_BACKENDS, KV_LAYOUTS, check_kv_layout
from .core.kv_connector import KVTransferConfig
from .core.kv_plan import KV_CACHE_DTYPES, check_kv_cache_dtype
from .core.step_budget import AUTO_ITL_RATIO, LatencyTarget
from .core.validation import is_int, require_int
from .kernels import KERNEL_CHOICES
from .model.config import GGUF_WEIGHTS, QUANTIZATION_CHOICES
from .model.device import DEVICE_CHOICES, DTYPE_CHOICES, check_device_options
from .spec_decode.config import SpeculativeConfig



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

# "auto" is the engine's own choice (engine/placement.py); load_model takes the rest.
ENGINE_QUANTIZATION = ("auto", *QUANTIZATION_CHOICES)


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "a .gguf file or HF folder; default: the embedded SmolLM2-135M-Instruct"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: int | None = field(default=None, metadata={"help": "bytes for the KV cache (e.g. 2GiB); default: a share of free RAM"})
    max_num_seqs: int = field(default=128, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": "a fixed token budget per step; default: chosen each step (a step beside decodes within "
                f"{AUTO_ITL_RATIO:g}x their decode-only time, at most {MIN_WHOLE_PROMPT_BUDGET} tokens) on cpu; "
                "a fixed budget on cuda (docs/gpu.md)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length limit; default: the model's"})
    enable_prefix_caching: bool | None = field(default=None, metadata={
        "help": "reuse KV of shared prompt prefixes (default: on with the paged layout, which alone can share)"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prefills across steps"})
    long_prefill_token_threshold: int = field(default=0, metadata={"help": "cap one prompt's tokens per step (0 = off)"})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs or priority"})
    policy: str = field(default="chunked", metadata={"help": "scheduler study mode: " + ", ".join(POLICIES)})
    attention_backend: str | None = field(default=None, metadata={
        "help": "native (the default with native kernels), cpu (the default with torch kernels), triton (CUDA) or reference"})
    kernels: str = field(default="auto", metadata={
        "help": "native: pagedserve's AVX2 op library; torch: pure torch; auto: native where the CPU and build allow"})
    itl_target_ms: float | None = field(default=None, metadata={
        "help": "choose each step's token budget to keep inter-token latency under this (chunked policy); "
                "--max-num-batched-tokens is then the cap (default 2048)"})
    ttft_target_ms: float | None = field(default=None, metadata={
        "help": "with a latency target: how long a step may take when no decode is running (default: up to the cap)"})
    quantization: str = field(default="auto", metadata={
        "help": "linear-layer weights: auto (gguf for a GGUF file on the CPU's native kernels, as llama.cpp "
                "runs it; else none); none (--dtype; a GGUF's blocks multiplied in fp32, see --gguf-weights); "
                "q8_0, q4_0, q4_1 (llama.cpp blocks, quantised at load) or gguf (a GGUF's own blocks with int8 "
                "activations), CPU-only, on the native kernels; fp8 (e4m3 with per-channel scales, through "
                "torch._scaled_mm)"})
    gguf_weights: str = field(default="blocks", metadata={
        "help": "with --quantization none: blocks (a GGUF's Q4_0/Q4_1/Q8_0 matrices read in place and multiplied "
                "in fp32 by the native kernels: the same model at a sixth of the bytes, fastest at small batches) "
                "or dense (inflated to fp32 matrices for oneDNN, which can be faster at large batches on AVX-512)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache elements: auto (fp16 beside a GGUF's int8 path, as llama.cpp; else the model's dtype), "
                "fp32, fp16 (half the bytes), fp8_e4m3 or fp8_e5m2 (a quarter); "
                "narrower ones are converted to fp32 as attention reads them"})
    kv_layout: str = field(default="paged", metadata={
        "help": "paged: blocks from a preallocated pool; contiguous: one demand-paged virtual region per "
                "request, committed by the OS as tokens arrive (no prefix caching, n > 1 or draft models)"})
    device: str = field(default="auto", metadata={
        "help": "cpu, cuda, or auto (cuda when torch sees one); see docs/gpu.md"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations: auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16 (cuda)"})
    enforce_eager: bool = field(default=False, metadata={"help": "cuda: run decode steps eagerly, no CUDA graphs"})
    max_cudagraph_batch: int | None = field(default=None, metadata={
        "help": "cuda: the largest decode batch captured in a CUDA graph (default min(max_num_seqs, 256))"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "cuda: share of the device's memory for weights, activations and the KV pool (without --kv-cache-memory)"})
    num_threads: int | None = field(default=None, metadata={
        "help": "torch threads (per tensor-parallel rank); default: all cores, shared among a node's ranks"})
    seed: int = field(default=0, metadata={"help": "seed for requests that give none"})
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, metadata={
        "help": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                'or \'{"method": "draft_model", "model": "self:8"}\''})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks the model's layers are split across, each in its own process (docs/tensor-parallel.md)"})
    distributed_init_method: str | None = field(default=None, metadata={
        "help": "where the ranks meet: tcp://host:port or env:// (MASTER_ADDR/MASTER_PORT); "
                "default: a free port on 127.0.0.1 (one node)"})
    nnodes: int = field(default=1, metadata={"help": "hosts the tensor-parallel ranks are spread over"})
    node_rank: int = field(default=0, metadata={
        "help": "this host's index among --nnodes (0 runs the engine; others run `pagedserve worker`)"})
    kv_transfer_config: KVTransferConfig | dict | str | None = field(default=None, metadata={
        "help": 'disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "PagedServeConnector", '
                '"kv_role": "kv_producer", "kv_port": 14579, "lease_seconds": 30}\' (see docs/disaggregated.md)'})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT folders) beside the base model; a request's model names one"})
    lora_modules: dict[str, str] | list[str] | None = field(default=None, metadata={
        "help": "adapters to load at start, as NAME=PATH (a folder with adapter_config.json and "
                "adapter_model.safetensors); needs --enable-lora"})
    max_loras: int = field(default=4, metadata={"help": "most LoRA adapters loaded at once"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest LoRA rank an adapter may have"})

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.quantization not in ENGINE_QUANTIZATION:
            raise ValueError(f"quantization must be one of {', '.join(ENGINE_QUANTIZATION)}, got {self.quantization!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.lora_modules = parse_lora_modules(self.lora_modules)
        for name in ("max_loras", "max_lora_rank"):
            require_int(name, getattr(self, name), 1)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"lora_modules names {len(self.lora_modules)} adapters; max_loras is {self.max_loras}")
        if self.device != "auto":
            check_device_options(self.device, self.dtype, self.quantization, self.kernels)
        elif self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        self._check_kv_layout()
        if self.quantization not in ("auto", "none", "fp8") and self.kernels == "torch":
            raise ValueError(f"quantization={self.quantization!r} runs on the native kernels; kernels='torch' has none")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 (the adapters are not sharded)")
        # Scheduler and cache fields are validated by core's SchedulerConfig / CacheConfig
        # when the engine builds them; only the engine's own fields are checked here.
        self._check_parallel()
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("kv_cache_memory", "num_threads", "max_cudagraph_batch"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name), 1)
        for name in ("itl_target_ms", "ttft_target_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a number of milliseconds > 0, got {value!r}")

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            require_int(name, getattr(self, name), 1)
        if not is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                             f"nnodes ({self.nnodes}): every node runs as many ranks")
        if self.nnodes > 1 and not self.distributed_init_method:
            raise ValueError("nnodes > 1 needs distributed_init_method (tcp://HOST:PORT of node 0, or env://)")
        method = self.distributed_init_method
        if method is not None and not (method.startswith("tcp://") or method == "env://"):
            raise ValueError(f"distributed_init_method must be tcp://host:port or env://, got {method!r}")
        if self.tensor_parallel_size > 1:
            if self.speculative_config is not None:
                raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")
            if self.quantization not in ("auto", "none"):
                raise ValueError(f"quantization={self.quantization!r} is not supported with tensor_parallel_size > 1 "
                                 "(the shards are fp32; use quantization='none')")
            if self.kv_transfer_config is not None:
                # The connector moves one rank's cache; the other ranks' shards would stay behind.
                raise ValueError("kv_transfer_config is not supported with tensor_parallel_size > 1")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def rank_num_threads(self) -> int:
        """Torch threads for one rank: the flag, else this host's cores shared by its ranks."""
        return self.num_threads or max(1, default_num_threads() // self.ranks_per_node)

    def _check_kv_layout(self) -> None:
        contiguous = check_kv_layout(self.kv_layout) == "contiguous"
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = not contiguous
        if not contiguous:
            if self.attention_backend in CONTIGUOUS_BACKENDS:
                raise ValueError(f"attention_backend {self.attention_backend!r} needs kv_layout='contiguous'")
            return
        # Sharing a prefix or a forked prompt means mapping the same pages into several
        # regions; docs/kv-layouts.md says why that is left to the paged layout.
        if self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching needs kv_layout='paged': the contiguous layout shares no pages")
        if self.tensor_parallel_size > 1 or self.kv_transfer_config is not None:
            # Its regions live in this process's address space, read by this process's attention.
            raise ValueError("kv_layout='contiguous' is not supported with tensor_parallel_size > 1 or kv_transfer_config")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("speculative_config method 'draft_model' needs kv_layout='paged' (its scratch blocks "
                             "are paged); use method 'ngram' with the contiguous layout")

    def effective_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The flag if given; else, when a target (given or automatic) sizes each step, the
        cap it works under; else (policies continuous, static, naive) a budget that holds
        a whole prompt, as vLLM."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        if self.latency_target() is not None:
            # The target sizes steps; the cap only has to let a wave of prompts into one (vLLM's 2,048).
            return MIN_WHOLE_PROMPT_BUDGET
        return whole_prompt_budget(max_model_len, self.max_num_seqs)

    @property
    def has_latency_target(self) -> bool:
        """Whether the user gave an ITL or TTFT target."""
        return self.itl_target_ms is not None or self.ttft_target_ms is not None

    def latency_target(self) -> LatencyTarget | None:
        """What sizes each step: the ITL/TTFT targets in seconds when given; else, for
        chunked prefill with no --max-num-batched-tokens, the automatic target (a step
        beside decodes within AUTO_ITL_RATIO of their decode-only time); None for the
        fixed budget the user asked for (or a policy that does not chunk)."""
        if self.has_latency_target:
            return LatencyTarget(_ms_to_s(self.itl_target_ms), _ms_to_s(self.ttft_target_ms))
        if self.max_num_batched_tokens is None and chunks_prefill(self.policy, self.enable_chunked_prefill):
            return LatencyTarget(itl_ratio=AUTO_ITL_RATIO)
        return None

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.effective_max_num_batched_tokens(max_model_len),
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
            policy=self.policy,
        )

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(num_blocks=num_blocks, block_size=self.block_size,
                           enable_prefix_caching=self.enable_prefix_caching)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help")
            if f.type in ("bool", "bool | None") or isinstance(f.default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            elif f.name == "kv_cache_memory":
                parser.add_argument(flag, type=parse_memory, default=None, help=help_text)
            elif f.name in ("model", "attention_backend", "speculative_config", "distributed_init_method",
                            "kv_transfer_config"):
                parser.add_argument(flag, type=str, default=f.default, help=help_text)
            elif f.name == "lora_modules":
                parser.add_argument(flag, nargs="+", default=None, metavar="NAME=PATH", help=help_text)
            elif f.name in ("itl_target_ms", "ttft_target_ms", "gpu_memory_utilization"):
                parser.add_argument(flag, type=float, default=f.default, help=help_text)
            elif f.name in ("policy", "scheduling_policy", "kernels", "quantization", "kv_cache_dtype", "device", "dtype",
                            "kv_layout", "gguf_weights"):
                choices = {"policy": POLICIES, "scheduling_policy": SCHEDULING_POLICIES, "kernels": KERNEL_CHOICES,
                           "quantization": ENGINE_QUANTIZATION, "gguf_weights": GGUF_WEIGHTS, "kv_cache_dtype": KV_CACHE_DTYPES,
                           "device": DEVICE_CHOICES, "dtype": DTYPE_CHOICES, "kv_layout": KV_LAYOUTS}[f.name]
                parser.add_argument(flag, choices=choices, default=f.default, help=help_text)
            else:
                parser.add_argument(flag, type=int, default=f.default, help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def describe(self) -> dict:
        return dataclasses.asdict(self)


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


def default_kv_cache_memory() -> int:
    """A quarter of the memory available now, capped at 2 GiB. For the 135M default
    model (46 KB of fp32 K/V per token) 2 GiB holds ~45k tokens, enough for 64
    concurrent 700-token sequences; the whole pool is zero-filled at start-up, so a
    larger default would only slow start-up. Pass kv_cache_memory for more."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return int(min(available // 4, 2 << 30))


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
