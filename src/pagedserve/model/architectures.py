"""The model class of each architecture: the Llama family's unless a module of its own
says otherwise (model/gemma.py)."""
from __future__ import annotations

from .gemma import GemmaModel
from .llama import LlamaModel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {"gemma2": GemmaModel, "gemma3": GemmaModel}


def model_class(architecture: str) -> type[LlamaModel]:
    return MODEL_CLASSES.get(architecture, LlamaModel)
