"""The names a request's `model` may take: the base model's served names and the loaded
LoRA adapters (kept on the event loop, changed only once the engine has loaded or
unloaded the adapter), and their /v1/models entries."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...engine.lora_registry import LoRAModule
from ...http.errors import APIError


class ServedModels:
    def __init__(self, base_names: Sequence[str], adapters: Sequence[LoRAModule] = ()):
        self.base_names = tuple(base_names)
        self.adapters: dict[str, LoRAModule] = {m.name: m for m in adapters}
        clash = set(self.base_names) & set(self.adapters)
        if clash:
            raise ValueError(f"LoRA adapter names {sorted(clash)} are also served model names")

    @property
    def names(self) -> list[str]:
        return [*self.base_names, *self.adapters]

    def resolve(self, name: str | None) -> str:
        """The name responses carry: the adapter's, else the first served name; 404 for a
        model this server does not serve."""
        if name is None or name in self.base_names:
            return self.base_names[0]
        if name in self.adapters:
            return name
        raise APIError(404, f"the model {name!r} does not exist; this server serves {self.names}",
                       param="model", code="model_not_found")

    def lora_of(self, name: str | None) -> str | None:
        """The adapter a (resolved) model name runs, None for the base model."""
        return name if name in self.adapters else None

    def cards(self, created: int, root: str, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries; an adapter's `root` is its path and its `parent` the base model, as vLLM."""
        card = {"object": "model", "created": created, "owned_by": "pagedserve", "max_model_len": max_model_len}
        return ([{"id": name, **card, "root": root, "parent": None} for name in self.base_names]
                + [{"id": m.name, **card, "root": m.path, "parent": self.base_names[0]}
                   for m in self.adapters.values()])
