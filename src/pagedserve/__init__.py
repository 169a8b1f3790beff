"""pagedserve: an LLM serving engine with PagedAttention, continuous batching and chunked prefill."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput"]

# Imported on first use, so `pagedserve.core` (pure Python) stays importable
# without torch: the simulator and the core tests depend on that.
_LAZY = {
    "LLM": "pagedserve.engine.llm",
    "SamplingParams": "pagedserve.sampling_params",
    "StructuredOutputs": "pagedserve.structured_output.spec",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
}

if TYPE_CHECKING:
    from .engine.llm import LLM
    from .outputs import CompletionOutput, RequestOutput
    from .sampling_params import SamplingParams
    from .structured_output.spec import StructuredOutputs


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
