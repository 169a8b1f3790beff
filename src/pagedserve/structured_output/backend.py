"""The interface a structured-output backend implements, and the one way to get one.

A backend compiles a (kind, text) spec into a `Grammar` once; each request (each
sample, for n > 1) then gets its own `Matcher` from it. llguidance is the one
backend today; outlines-core or xgrammar would plug in by implementing these three
classes and registering in `make_backend`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..model.tokenizer import Tokenizer


class Matcher(ABC):
    """One sequence's position in a grammar: which tokens may come next."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, bit t of word t // 32)."""

    @abstractmethod
    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over sampled tokens; False (and `error` set) if one is not allowed."""

    @abstractmethod
    def fork(self) -> Matcher:
        """An independent copy in the same state."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing but end-of-sequence (or the matcher failed)."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher failed, None while it is healthy."""


class Grammar(ABC):
    """A compiled spec, shared by every request that asks for the same one."""

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""


class StructuredOutputBackend(ABC):
    @abstractmethod
    def compile(self, kind: str, text: str) -> Grammar:
        """Compile a spec (kind in spec.KINDS); ValueError with the reason if it is invalid."""


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
