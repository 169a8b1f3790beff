"""The LoRA adapters an engine serves, by name.

Each load gets a new integer id (from 1; 0 is the base model) that is never reused: the
id is what a core Request carries and what keys the prefix cache, so blocks computed
under an adapter that was unloaded can never be served to whatever is loaded next, even
under the same name and path (the files may have changed).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..model.config import ModelConfig
from ..model.lora import LoRASlots, load_peft_adapter


class UnknownLoRAError(ValueError):
    """No adapter of that name is loaded (the server answers 404)."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    name: str
    path: str
    lora_id: int
    rank: int


class LoRARegistry:
    def __init__(self, slots: LoRASlots, model_config: ModelConfig):
        self._slots = slots
        self._model_config = model_config
        self._modules: dict[str, LoRAModule] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAModule:
        """Read, check and install an adapter; ValueError (naming the problem) if it cannot be."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must be a non-empty string, got {path!r}")
        if name in self._modules:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        if len(self._modules) >= self._slots.max_loras:
            raise ValueError(f"max_loras ({self._slots.max_loras}) adapters are loaded; unload one first")
        adapter = load_peft_adapter(path, self._model_config, self._slots.max_rank)
        module = LoRAModule(name, path, next(self._ids), adapter.rank)
        self._slots.add(module.lora_id, adapter)
        self._modules[name] = module
        return module

    def unload(self, name: str) -> LoRAModule:
        module = self.get(name)
        self._slots.remove(module.lora_id)
        del self._modules[name]
        return module

    def get(self, name: str) -> LoRAModule:
        module = self._modules.get(name)
        if module is None:
            raise UnknownLoRAError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self._modules)}")
        return module

    def modules(self) -> list[LoRAModule]:
        return list(self._modules.values())
