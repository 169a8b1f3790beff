"""Prompt-lookup (n-gram) proposals: if the sequence's last n tokens occurred
before, propose what followed them then. Free to compute, and right whenever the
output copies its input (edits, quotes, code, extraction)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix of length n_max .. n_min; [] when no suffix recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # Windows that end before the suffix starts, so a match is followed by a token.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, requests: Sequence) -> list[list[int]]:
        return [propose_ngram(r.all_token_ids, self.k, self.n_min, self.n_max) for r in requests]
