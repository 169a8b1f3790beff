"""PoolingParams: how one embedding request turns its prompt into a vector.

A pooling request computes its prompt and never samples (core/request.py `pooling`);
the runner pools the final-norm hidden states (worker/pooling.py) and the engine then
truncates and normalises the vector as these parameters say. Torch-free, like
SamplingParams.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .core.request import POOLING_TYPES
from .core.validation import is_int

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    # "last", "mean" or "cls"; None: the engine's pooling_type option.
    pooling_type: str | None = None
    # L2-normalise the vector (after any truncation), as OpenAI's embeddings are.
    normalize: bool = True
    # Keep the first `dimensions` components (Matryoshka truncation); None: all of them.
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES} or None, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1 or None, got {self.dimensions!r}")

    def validate_for_model(self, hidden_size: int) -> None:
        """ValueError when `dimensions` exceeds the model's embedding size."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions must be <= the model's embedding size ({hidden_size}), "
                             f"got {self.dimensions}")


def score_pairs(text_1: T | list[T], text_2: T | list[T], is_one: Callable[[object], bool]) -> list[tuple[T, T]]:
    """The (text_1, text_2) pairs a score request means, as vLLM's /v1/score: one against
    one, one against each of a list, or two lists of equal length pairwise. `is_one` tells
    a single item from a list of them (a string, or token ids). ValueError otherwise."""
    firsts = [text_1] if is_one(text_1) else list(text_1)
    seconds = [text_2] if is_one(text_2) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one text_1, "
                         "or as many as text_2")
    return list(zip(firsts, seconds))


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """The score of two embeddings (the score of an embedding model, as vLLM's for one)."""
    norm = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norm if norm else 0.0
