"""Pooling a request's prompt into one vector, across the steps its prefill takes.

The source is the model's final-norm hidden state (what transformers returns as
`hidden_states[-1]` and sentence-transformers pools on decoder models). A pooling row
asks the step for the hidden rows it needs: the prompt's last token once the prompt is
done ("last"), every token of the chunk ("mean"), or position 0 ("cls"). A prompt split
into chunks carries its partial result between steps here, keyed by request id; the
runner drops it when the request finishes or is preempted (a preempted request
recomputes from its start).

Mean pooling adds the token rows in position order one at a time, in float64 (a
cumulative sum continued from the previous chunk's), so on the CPU its bits do not
depend on how the prompt was chunked or what shared its steps, like the rows
themselves (docs/architecture.md); a GPU's scan may order the additions differently.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..pooling_params import PoolingParams


@dataclass(slots=True, frozen=True)
class PoolingRow:
    request_id: str
    pooling: str  # "last", "mean" or "cls"
    num_rows: int  # hidden rows this step gives it (in plan order)
    done: bool  # the step computes the prompt's last token


@dataclass(slots=True)
class PoolingPlan:
    rows: list[PoolingRow]
    # Token offsets (in the step's flat token list) of the hidden rows the rows need, in order.
    hidden_indices: np.ndarray


def plan_pooling(sched: Sequence, token_start: np.ndarray) -> PoolingPlan | None:
    """The step's pooling rows; `token_start[i]`: where row i's tokens start in the flat list."""
    rows: list[PoolingRow] = []
    indices: list[np.ndarray] = []
    for i, s in enumerate(sched):
        kind = s.request.pooling
        if kind is None or s.is_padding:
            continue
        first, n = int(token_start[i]), s.num_new_tokens
        done = s.start + n == s.request.num_prompt_tokens
        if kind == "mean":
            wanted = np.arange(first, first + n)
        elif kind == "last":
            wanted = np.array([first + n - 1] if done else [], dtype=np.int64)
        else:
            wanted = np.array([first] if s.start == 0 else [], dtype=np.int64)
        if len(wanted) or done:
            rows.append(PoolingRow(s.request_id, kind, len(wanted), done))
            indices.append(wanted)
    if not rows:
        return None
    return PoolingPlan(rows, np.concatenate(indices).astype(np.int64))


class PoolingState:
    """Partial results of prompts still in prefill: (running sum, token count) for mean
    pooling, the position-0 row for cls pooling."""

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def drop(self, request_id: str) -> None:
        self._partial.pop(request_id, None)

    def collect(self, plan: PoolingPlan, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Take this step's final-norm hidden rows (`plan.hidden_indices`' rows, fp32, on
        the CPU); return the pooled vector of every request whose prompt finished."""
        pooled: dict[str, torch.Tensor] = {}
        offset = 0
        for row in plan.rows:
            part = hidden[offset:offset + row.num_rows]
            offset += row.num_rows
            if row.pooling == "last":
                vector, count = part[0], 1
            elif row.pooling == "mean":
                prev = self._partial.pop(row.request_id, None)
                rows = part.double() if prev is None else torch.cat([prev[0][None], part.double()])
                vector, count = rows.cumsum(0)[-1], row.num_rows + (prev[1] if prev is not None else 0)
            else:
                vector, count = (part[0], 1) if row.num_rows else self._partial.pop(row.request_id)
            if row.done:
                pooled[row.request_id] = (vector / count).float() if row.pooling == "mean" else vector.clone()
            else:
                self._partial[row.request_id] = (vector.clone(), count)
        return pooled


def finish_embedding(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """The vector a caller gets: truncated to `dimensions`, then L2-normalised if asked."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
