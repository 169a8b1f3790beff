"""Engine configuration: one dataclass whose fields map 1:1 to CLI flags and to
`LLM(**options)`. Validation happens here, once, with errors naming the field."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields

from .core.config import POLICIES, SCHEDULING_POLICIES, whole_prompt_budget
from .spec_decode.config import SpeculativeConfig

# Default token budget per step on a CPU. A step costs about 2 x params FLOPs per
# token; at ~90 GFLOP/s (fp32, 2 cores) and ~0.2 GFLOP/token for a 135M model, a
# 256-token step takes ~0.6 s. vLLM's GPU default (2048) would stall every decode
# for ~5 s behind a long prompt here; 256 keeps the worst inter-token gap well
# under a second while chunks stay large enough for efficient matmuls.
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


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


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "a .gguf file or HF folder; default: the embedded SmolLM2-135M-Instruct"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: int | None = field(default=None, metadata={"help": "bytes for the KV cache (e.g. 2GiB); default: a share of free RAM"})
    max_num_seqs: int = field(default=128, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": f"token budget per step (CPU default {CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS})"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length limit; default: the model's"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV of shared prompt prefixes"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prefills across steps"})
    long_prefill_token_threshold: int = field(default=0, metadata={"help": "cap one prompt's tokens per step (0 = off)"})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs or priority"})
    policy: str = field(default="chunked", metadata={"help": "scheduler study mode: " + ", ".join(POLICIES)})
    attention_backend: str | None = field(default=None, metadata={"help": "cpu (default) or reference"})
    num_threads: int | None = field(default=None, metadata={"help": "torch threads; default: all cores"})
    seed: int = field(default=0, metadata={"help": "seed for requests that give none"})
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, metadata={
        "help": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                'or \'{"method": "draft_model", "model": "self:8"}\''})

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        # Scheduler and cache fields are validated by core's SchedulerConfig / CacheConfig
        # when the engine builds them; only the engine's own fields are checked here.
        for name in ("kv_cache_memory", "num_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def effective_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The flag if given; else 256 when prompts are chunked, and when they are not
        (policies continuous, static, naive) a budget that holds a whole prompt, as vLLM."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        if self.policy == "chunked" and self.enable_chunked_prefill:
            return CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
        return whole_prompt_budget(max_model_len, self.max_num_seqs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help")
            if f.type in ("bool",) or isinstance(f.default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            elif f.name == "kv_cache_memory":
                parser.add_argument(flag, type=parse_memory, default=None, help=help_text)
            elif f.name in ("model", "attention_backend", "speculative_config"):
                parser.add_argument(flag, type=str, default=f.default, help=help_text)
            elif f.name in ("policy", "scheduling_policy"):
                choices = POLICIES if f.name == "policy" else SCHEDULING_POLICIES
                parser.add_argument(flag, choices=choices, default=f.default, help=help_text)
            else:
                parser.add_argument(flag, type=int, default=f.default, help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def describe(self) -> dict:
        return dataclasses.asdict(self)


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
