"""Where and how the engine runs: `--device`, `--kernels`, `--quantization` and
`--kv-cache-dtype` resolved, with the options that follow from them checked."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.selector import TRITON_BACKEND
from ..config import EngineConfig
from ..kernels import resolve_kernels
from ..model.device import check_device_options, resolve_device_name, resolve_dtype_name, torch_dtype
from ..model.loader import LoadedModel
from ..model.sources import resolve_model


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: str  # "float32", "bfloat16" or "float16"
    quantization: str  # never "auto"
    kernels: str  # "native" or "torch"
    kv_cache_dtype: str  # "auto" only where it means the model's dtype

    @property
    def load_quantization(self) -> str:
        """What load_model builds: fp8 is made from the unquantised weights when the model is placed."""
        return "none" if self.quantization == "fp8" else self.quantization

    @property
    def on_gpu(self) -> bool:
        return self.device.type != "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def keeps_loaded_model(self) -> bool:
        """The CPU fp32 path uses the model as loaded (oneDNN-packed); anything else is placed
        (model/placement.py) from unpacked weights."""
        return not self.on_gpu and self.quantization != "fp8"


def resolve_placement(config: EngineConfig, loaded: LoadedModel | None = None) -> Placement:
    """`loaded`: a model the caller loaded, whose quantization "auto" then means."""
    device = resolve_device_name(config.device)
    check_device_options(device, config.dtype, config.quantization, config.kernels)
    if device != "cpu":
        if config.attention_backend not in (None, TRITON_BACKEND):
            raise ValueError(f"attention_backend={config.attention_backend!r} runs on cpu; on cuda use "
                             f"{TRITON_BACKEND!r} (the default there)")
        spec = config.speculative_config
        if spec is not None and spec.method != "ngram":
            raise ValueError("speculative decoding with a draft model runs on cpu only; on cuda use method 'ngram'")
    kernels = "torch" if device != "cpu" else resolve_kernels(config.kernels)
    quantization = _quantization(config, kernels, loaded)
    # fp16 KV costs nothing measured in accuracy (docs/benchmarks.md) and halves what
    # decode attention reads; llama.cpp stores f16 too. Beside fp32 weights "auto" stays
    # the model's dtype, so the fp32 path remains the exact oracle of transformers.
    kv_cache_dtype = "fp16" if config.kv_cache_dtype == "auto" and quantization == "gguf" else config.kv_cache_dtype
    return Placement(torch.device(device), resolve_dtype_name(config.dtype, device), quantization, kernels,
                     kv_cache_dtype)


def _quantization(config: EngineConfig, kernels: str, loaded: LoadedModel | None) -> str:
    """"auto": a GGUF file's own blocks with int8 activations where the native kernels run
    them on one rank, as llama.cpp runs the file (perplexity within 0.3% of fp32 on the
    blocks, docs/benchmarks.md); otherwise the weights as --dtype."""
    if config.quantization != "auto":
        return config.quantization
    if loaded is not None:
        return loaded.quantization
    if kernels != "native" or config.tensor_parallel_size > 1:
        return "none"
    return "gguf" if resolve_model(config.model).kind == "gguf" else "none"
