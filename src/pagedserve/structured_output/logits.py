"""One step's constrained rows: fill their token bitmasks, mask their logits, advance.

The runner calls `constrain(logits, matchers)` before any other logits processing
(bias, penalties, temperature and filters then only ever see allowed tokens) and
`advance` with each request's kept tokens after the draw. Plain torch / numpy ops throughout:
`torch.compile` would cost seconds on its first call here.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from .grammar_backend import Matcher

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


def advance(matcher: Matcher, token_ids: Sequence[int]) -> None:
    """Move a request's matcher over the tokens it kept this step."""
    if not matcher.accept(token_ids):
        # The runner keeps a refused token only when nothing in its row was accepted
        # (worker/row_sampling.py); the engine then ends the request with "error".
        logger.warning("structured output matcher rejected tokens %s: %s", list(token_ids), matcher.error)


def constrain(
    logits: torch.Tensor, matchers: Sequence[Matcher | None], drafts: Sequence[tuple[int, ...]] | None = None
) -> list[int]:
    """Mask each row of `logits` whose matcher is not None to its allowed tokens;
    return those rows (empty when none is constrained, and nothing was done).

    Speculative decoding: row i's mask is taken after drafts[i], the unverified
    drafts before its position, on a copy of the matcher. A row whose drafts the
    grammar refuses stays unmasked: the mask of the position holding the refused
    draft rules it out, so this row's sample is never kept.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return rows
    bitmask = torch.empty(len(rows), bitmask_words(logits.shape[-1]), dtype=torch.int32)
    for i, row in enumerate(rows):
        matcher = matchers[row]
        prefix = drafts[row] if drafts is not None else ()
        if prefix:
            matcher = matcher.fork()
            if not matcher.accept(prefix):
                bitmask[i] = -1
                continue
        matcher.fill_bitmask(bitmask, i)
    apply_bitmask(logits, bitmask, None if len(rows) == logits.shape[0] else torch.tensor(rows))
    return rows
