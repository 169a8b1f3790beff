"""Where and how the engine runs: `--device` resolved here (it asks torch), then every
other option resolved and checked by EngineConfig.resolve."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine_config import EngineConfig
from ..model.device import resolve_device_name, torch_dtype
from ..model.loader import LoadedModel
from ..resolved_config import ResolvedConfig


@dataclass(frozen=True)
class Placement:
    """A resolved config and what follows from its device and load parts for loading and
    placing the model."""

    config: ResolvedConfig

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device.name)

    @property
    def load_quantization(self) -> str:
        return self.config.load.load_quantization

    @property
    def on_gpu(self) -> bool:
        return self.config.device.on_gpu

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.config.device.dtype)

    @property
    def keeps_loaded_model(self) -> bool:
        """The CPU fp32 path uses the model as loaded (oneDNN-packed); anything else is placed
        (model/placement.py) from unpacked weights."""
        return not self.on_gpu and self.config.load.quantization != "fp8"


def resolve_placement(config: EngineConfig, loaded: LoadedModel | None = None) -> Placement:
    """`loaded`: a model the caller loaded, whose quantization "auto" then means."""
    return Placement(config.resolve(resolve_device_name(config.device),
                                    loaded.quantization if loaded is not None else None))
