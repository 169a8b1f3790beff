"""Verification of draft tokens against the target model.

Both proposers draft greedily, so a draft token d is a point mass q = onehot(d).
Rejection sampling with such a q (accept d with probability min(1, p(d) / q(d)) =
p(d); on rejection draw from the residual (p - q)+, i.e. p without d, renormalised)
is exactly: draw x ~ p as usual and accept d iff x == d, else emit x. So the
runner samples every verified position with the ordinary sampler (penalties,
filters, seeds and all, each position seeing the drafts before it as history) and
keeps the longest prefix where the sample equals the draft, plus the sample that
ended it (or the bonus token after the last draft). The output distribution is the
target's, token for token; greedy rows reduce to "accept while argmax == draft".
"""
from __future__ import annotations

import numpy as np


def num_accepted(sampled: np.ndarray, first: np.ndarray, drafts: list[tuple[int, ...]]) -> np.ndarray:
    """Accepted drafts per row: `sampled` holds every position's token laid end to end,
    row i's 1 + len(drafts[i]) positions starting at first[i]."""
    k = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
    width = int(k.max()) if len(k) else 0
    cols = np.arange(width)
    inside = cols < k[:, None]
    targets = np.where(inside, sampled[np.where(inside, first[:, None] + cols, 0)], -1)
    proposed = np.full((len(drafts), width), -2, dtype=np.int64)
    proposed[inside] = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(k.sum()))
    return np.cumprod(targets == proposed, axis=1).sum(axis=1)
