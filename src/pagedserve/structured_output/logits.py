"""One step's constrained rows: fill their token bitmasks, mask their logits, advance.

The runner calls `constrain(logits, matchers)` before any other logits processing
(bias, penalties, temperature and filters then only ever see allowed tokens) and
`accept` with the sampled ids after the draw. Plain torch / numpy ops throughout:
`torch.compile` would cost seconds on its first call here.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from .backend import Matcher

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0.

    Bit t lives in int32 word t // 32 at bit t % 32, so in the little-endian bytes of
    the words it is byte t // 8, bit t % 8: numpy's little-endian unpackbits of the
    inverted mask is directly the [rows, vocab] "banned" matrix. `rows` None means
    every row.
    """
    vocab = logits.shape[-1]
    words = np.invert(bitmask.numpy()).astype("<i4", copy=False)
    banned = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    banned = torch.from_numpy(banned).view(torch.bool)[:, :vocab]
    if rows is None:
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))


class GrammarStep:
    """The constrained rows of one step, in batch order, and their matchers."""

    def __init__(self, rows: list[int], matchers: list[Matcher]):
        self.rows = rows
        self.matchers = matchers

    def accept(self, sampled_token_ids: torch.Tensor) -> None:
        """Advance each constrained row's matcher over its sampled token."""
        tokens = sampled_token_ids.tolist()
        for row, matcher in zip(self.rows, self.matchers):
            token = tokens[row]
            if not matcher.accept((token,)):
                # Cannot happen for a token the mask allowed; the request then ends (is_terminated).
                logger.warning("structured output matcher rejected token %d: %s", token, matcher.error)


def constrain(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> GrammarStep | None:
    """Mask each row of `logits` whose matcher is not None to its allowed tokens.

    Returns the step's constrained rows for `GrammarStep.accept`, or None when no row
    is constrained (and nothing was done).
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    active = [matchers[i] for i in rows]
    bitmask = torch.empty(len(rows), bitmask_words(logits.shape[-1]), dtype=torch.int32)
    for i, matcher in enumerate(active):
        matcher.fill_bitmask(bitmask, i)
    apply_bitmask(logits, bitmask, None if len(rows) == logits.shape[0] else torch.tensor(rows))
    return GrammarStep(rows, active)
