"""The interface a structured-output backend implements.

A backend compiles a (kind, text) spec into a `Grammar` once; each request (each
sample, for n > 1) then gets its own `Matcher` from it. llguidance is the one
backend today; outlines-core or xgrammar would plug in by implementing these three
classes and registering in `registry.make_backend`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class Matcher(ABC):
    """One sequence's position in a grammar: which tokens may come next."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, bit t of word t // 32)."""

    @abstractmethod
    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over sampled tokens; False (and `error` set) if one is not allowed."""

    @abstractmethod
    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept, without moving."""

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
