"""Prompt logprobs: the logprob of every prompt token given the ones before it, and the
top-k there, computed from the prefill steps' hidden states.

A prefill chunk covers positions [start, start + n); the logits at position p are the
distribution of token p + 1, so the chunk yields the logprobs of prompt tokens
start + 1 .. min(start + n, P - 1) (the last position's logits sample the first output
token as usual). Only rows whose request asks pay for the extra lm_head rows: the others
add nothing to the step. Positions served from the prefix cache have no logits, so
such requests skip the prefix cache (Request.skip_prefix_cache), as vLLM does.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .sampler import LogprobsTensors, gather_logprobs


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first .. first + len - 1 of one request."""

    request_id: str
    first: int  # the prompt position of the first token these logprobs are for (>= 1)
    logprobs: LogprobsTensors


@dataclass(slots=True)
class PromptLogprobsPlan:
    """Which rows of a step need prompt logprobs, and their logits indices (token offsets)."""

    rows: list[tuple[object, int, int]]  # (ScheduledRequest, first position, count)
    logits_indices: np.ndarray


def plan_prompt_logprobs(sched: Sequence, token_start: np.ndarray) -> PromptLogprobsPlan | None:
    """`token_start[i]`: where row i's tokens start in the step's flat token list."""
    rows = []
    indices = []
    for i, s in enumerate(sched):
        if s.request.sampling.params.prompt_logprobs is None or s.draft_token_ids:
            continue
        end = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1)
        if end <= s.start:
            continue  # a decode, or the chunk holding only the last prompt position
        rows.append((s, s.start + 1, end - s.start))
        indices.append(np.arange(token_start[i], token_start[i] + end - s.start))
    if not rows:
        return None
    return PromptLogprobsPlan(rows, np.concatenate(indices))


def compute_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan) -> list[PromptLogprobsChunk]:
    """`logits`: float32 [len(plan.logits_indices), V], the plan's rows in order."""
    raw = logits.log_softmax(dim=-1)
    out = []
    offset = 0
    for s, first, count in plan.rows:
        prompt = s.request.prompt_token_ids
        targets = torch.tensor(prompt[first:first + count], dtype=torch.int64)
        rows = torch.arange(count, dtype=torch.int64)
        k = s.request.sampling.params.prompt_logprobs
        out.append(PromptLogprobsChunk(s.request_id, first,
                                       gather_logprobs(raw[offset:offset + count], targets, rows, k)))
        offset += count
    return out
