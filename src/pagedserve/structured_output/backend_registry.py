"""Structured-output backends by name: the one module that knows every implementation,
so the interface (grammar_backend.py) and each backend import only downwards."""
from __future__ import annotations

from ..model.tokenizer import Tokenizer
from .grammar_backend import StructuredOutputBackend

BACKENDS = ("llguidance",)


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> StructuredOutputBackend:
    """The named backend over this tokenizer, with bitmasks `vocab_size` (the model's logits) wide.

    ValueError when the backend is unknown or its package is not installed, so a
    constrained request fails like any other bad request instead of crashing.
    """
    if name == "llguidance":
        try:
            from .llguidance_backend import LLGuidanceBackend
        except ImportError as e:
            raise ValueError(
                f"structured_outputs needs the llguidance package ({e}); install it with "
                "`pip install 'pagedserve[guided]'`"
            ) from None
        return LLGuidanceBackend(tokenizer, vocab_size)
    raise ValueError(f"structured output backend must be one of {list(BACKENDS)}, got {name!r}")
