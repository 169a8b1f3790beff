"""Beam search's share of a step on the device: each group's best continuations.

A beam row gives one logits row (its live beam's next-token distribution). Its
log-softmax plus the beam's cumulative logprob scores every (beam, token) pair; each
group keeps its best `num_candidates` over all its beams and the whole vocabulary (as
transformers' beam search does: a top-k per row, then one over each group's rows). Only those few candidates leave the device; core/beam_search.py decides.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.beam_search import BeamCandidates
from ..core.scheduler_output import ScheduledRequest
from ..core.request import Request


@dataclass(frozen=True, slots=True)
class SplitRows:
    """A step's sampling rows with its beam rows taken out."""

    sampling: list[ScheduledRequest]
    first_logits_row: np.ndarray  # of the rows kept, into the kept logits rows
    kept_logits_rows: np.ndarray
    beam_members: list[Request]
    beam_logits_rows: np.ndarray


def split_beam_rows(sampling: list[ScheduledRequest], first_logits_row: np.ndarray) -> SplitRows:
    is_beam = np.fromiter((s.request.beam is not None for s in sampling), bool, len(sampling))
    counts = np.fromiter((s.num_samples for s in sampling), np.int64, len(sampling))
    owner = np.repeat(np.arange(len(sampling)), counts)
    kept_counts = counts[~is_beam]
    first = np.zeros(len(kept_counts), dtype=np.int64)
    np.cumsum(kept_counts[:-1], out=first[1:])
    return SplitRows(
        sampling=[s for s, b in zip(sampling, is_beam.tolist()) if not b],
        first_logits_row=first,
        kept_logits_rows=np.nonzero(~is_beam[owner])[0],
        beam_members=[s.request for s, b in zip(sampling, is_beam.tolist()) if b],
        beam_logits_rows=first_logits_row[is_beam],
    )


def beam_candidates(logits: torch.Tensor, members: list[Request]) -> dict[str, BeamCandidates]:
    """Each group's best continuations (by root request id), best first, from the logits
    rows of its live members (`logits[i]` is `members[i]`'s)."""
    rows_of: dict[str, list[int]] = {}
    for i, member in enumerate(members):
        rows_of.setdefault(member.parent_id or member.request_id, []).append(i)
    width = max(map(len, rows_of.values()))
    index = torch.zeros((len(rows_of), width), dtype=torch.int64)
    base = torch.full((len(rows_of), width), float("-inf"))
    for g, rows in enumerate(rows_of.values()):
        group = members[rows[0]].beam
        index[g, : len(rows)] = torch.tensor(rows)
        base[g, : len(rows)] = torch.tensor([group.scores[members[r].index] for r in rows])
    vocab = logits.shape[-1]
    device = logits.device
    k = min(max(members[rows[0]].beam.num_candidates for rows in rows_of.values()), vocab)
    # A group's best k (beam, token) pairs are among each of its beams' own best k tokens (a
    # beam adds one score to all its tokens), so each row keeps its top k before the groups
    # meet: [groups, beams, k] scores instead of [groups, beams, vocab].
    row_top, row_tokens = torch.log_softmax(logits.float(), dim=-1).topk(k)
    index = index.to(device)
    scores = row_top[index] + base.to(device)[:, :, None]
    top, flat = scores.view(len(rows_of), -1).topk(min(k, width * k))
    tokens = row_tokens[index].view(len(rows_of), -1).gather(1, flat)
    top, flat, tokens = top.tolist(), flat.tolist(), tokens.tolist()
    out = {}
    for g, (root, rows) in enumerate(rows_of.items()):
        # A group with fewer rows than the widest pads with -inf: those entries sort last and are cut.
        n = min(members[rows[0]].beam.num_candidates, len(rows) * vocab)
        out[root] = BeamCandidates([members[rows[f // k]].index for f in flat[g][:n]], tokens[g][:n], top[g][:n])
    return out
