"""Where the engine runs: `--device` resolved, with the options that follow from it checked."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.selector import TRITON_BACKEND
from ..config import EngineConfig
from ..model.device import check_device_options, resolve_device_name, resolve_dtype_name, torch_dtype


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: str  # "float32", "bfloat16" or "float16"
    quantization: str

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


def resolve_placement(config: EngineConfig) -> Placement:
    device = resolve_device_name(config.device)
    check_device_options(device, config.dtype, config.quantization, config.kernels)
    if device != "cpu":
        if config.attention_backend not in (None, TRITON_BACKEND):
            raise ValueError(f"attention_backend={config.attention_backend!r} runs on cpu; on cuda use "
                             f"{TRITON_BACKEND!r} (the default there)")
        spec = config.speculative_config
        if spec is not None and spec.method != "ngram":
            raise ValueError("speculative decoding with a draft model runs on cpu only; on cuda use method 'ngram'")
    return Placement(torch.device(device), resolve_dtype_name(config.dtype, device), config.quantization)
