"""Turning a step's logits into tokens per request: plain rows, parallel-sampling
fork rows (n samples, each with its child's generator) and speculative rows (one
sample per verified position, then the accepted prefix; see spec_decode/verify.py).
A request with reasoning markers is read through its ReasoningState (core/reasoning.py):
rows past its thinking budget draw the end marker, and its grammar sees only its answer
(docs/thinking-budget.md)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.beam_search import BeamCandidates
from ..core.scheduler_output import ScheduledRequest
from ..core.request import Request
from ..sampling_params import token_seed
from ..sampling_state import SamplingState
from ..spec_decode.verify import num_accepted
from ..structured_output.grammar_backend import Matcher
from ..structured_output.logits import advance, constrain
from .prompt_logprobs import PromptLogprobsChunk
from .sampler import LogprobsTensors, SamplingRow, build_sampling_metadata, make_generator, sample

logger = logging.getLogger(__name__)

# A grammar's mask can allow a token its own matcher then refuses (llguidance's class of
# "consume rejects a token the mask just allowed"); each refusal is redrawn from the rest
# of the mask, this many times at most before the request ends with finish_reason "error".
MAX_REDRAWS = 16


@dataclass
class RunnerOutput:
    # Sampled token ids per request id: one each, n at a parallel-sampling fork point,
    # the accepted drafts plus one for a speculative row.
    sampled: dict[str, list[int]]
    # Logprobs of the rows that asked for them (None when none did), and for each
    # such row the request it was sampled for and the sample index (i at a fork).
    logprobs: LogprobsTensors | None
    logprob_samples: list[tuple[Request, int]]
    # Prompt logprobs computed this step (requests with prompt_logprobs in prefill).
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    # Pooling requests whose prompt this step finished: request id -> pooled final hidden
    # state (fp32, CPU, before truncation or normalisation; worker/pooling.py).
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    # Beam search: each group's best continuations this step, by root request id.
    beams: dict[str, BeamCandidates] = field(default_factory=dict)


def _generator(seed: int | None, position: int) -> torch.Generator | None:
    return None if seed is None else make_generator(token_seed(seed, position))


@dataclass
class _LogitsRows:
    """A step's logits rows as the sampler and the grammars see them, in order."""

    rows: list[SamplingRow] = field(default_factory=list)
    samples: list[tuple[Request, int]] = field(default_factory=list)
    # Each row's grammar matcher (None: unconstrained there, e.g. while the sample thinks)
    # and the answer tokens among the drafts before it.
    matchers: list[Matcher | None] = field(default_factory=list)
    drafts_before: list[tuple[int, ...]] = field(default_factory=list)
    # (row, token id) the row must draw: a thinking budget closing its section.
    forced: list[tuple[int, int]] = field(default_factory=list)

    def add(self, row: SamplingRow, sample: tuple[Request, int], matcher: Matcher | None,
            drafts_before: tuple[int, ...], forced: int | None) -> None:
        if forced is not None:
            self.forced.append((len(self.rows), forced))
        self.rows.append(row)
        self.samples.append(sample)
        self.matchers.append(matcher)
        self.drafts_before.append(drafts_before)


def _logits_rows(sampling: list[ScheduledRequest]) -> _LogitsRows:
    out = _LogitsRows()
    for s in sampling:
        req = s.request
        state: SamplingState = req.sampling
        reasoning = state.reasoning
        if reasoning is not None:
            reasoning.sync(req.output_token_ids)
        forced, answering = (None, True) if reasoning is None else (reasoning.forced_token(), reasoning.in_answer)
        if s.draft_token_ids:
            _add_speculative(out, s, state)
        elif s.num_samples > 1:
            # A parallel-sampling fork: sample i is drawn with child i's own generator.
            for i in range(s.num_samples):
                out.add(SamplingRow(state.params, req.prompt_token_ids, req.output_token_ids,
                                    _generator(state.fork_seeds[i], len(req.output_token_ids))),
                        (req, i), state.fork_matchers[i] if answering else None, (), forced)
        else:
            out.add(SamplingRow(state.params, req.prompt_token_ids, req.output_token_ids,
                                _generator(state.seed, len(req.output_token_ids))),
                    (req, req.index), state.matcher if answering else None, (), forced)
    return out


def _add_speculative(out: _LogitsRows, s: ScheduledRequest, state: SamplingState) -> None:
    """Position j of a speculative row is sampled as if drafts 0 .. j - 1 were already output:
    its history, its thinking budget and its grammar state all follow them."""
    req, drafts = s.request, s.draft_token_ids
    views = state.reasoning.positions(drafts) if state.reasoning is not None else [(None, 0)] * s.num_samples
    history = list(req.output_token_ids)
    for j, (forced, answer_start) in zip(range(s.num_samples), views):
        answering = answer_start is not None
        out.add(SamplingRow(state.params, req.prompt_token_ids, history[:], _generator(state.seed, len(history))),
                (req, req.index), state.matcher if answering else None,
                tuple(drafts[answer_start:j]) if answering else (), forced)
        if j < len(drafts):
            history.append(drafts[j])


def sample_rows(
    logits: torch.Tensor, sampling: list[ScheduledRequest], first_logits_row: np.ndarray, eos_token_ids: tuple[int, ...] = ()
) -> RunnerOutput:
    """Sample every logits row of a step and verify speculative rows.

    `sampling` holds the step's rows that sample (ScheduledRequests) in order, row i
    owning logits rows first_logits_row[i] .. + num_samples.
    """
    built = _logits_rows(sampling)
    rows, matchers = built.rows, built.matchers
    meta = build_sampling_metadata(rows, logits.shape[-1], eos_token_ids, built.forced)
    if logits.device.type != "cpu" and not (meta.argmax_only and not any(matchers)):
        # Penalties, filters, seeded draws, grammar masks and logprobs run on the host.
        logits = logits.cpu()
    # Before any other processing, so penalties and filters only see allowed tokens.
    constrained = constrain(logits, matchers, built.drafts_before)
    # The masked rows before `sample` consumes them (it works in place), to redraw a token
    # the grammar refuses: one copy of each constrained row a step (~0.2 MB a row here),
    # against rebuilding the row's logits, which are gone once it is sampled.
    masked = dict(zip(constrained, logits[constrained])) if constrained else {}
    result = sample(logits, meta)
    tokens = result.sampled_token_ids.cpu().numpy()
    keep = np.fromiter((s.num_samples for s in sampling), np.int64, len(sampling))
    speculative = [i for i, s in enumerate(sampling) if s.draft_token_ids]
    if speculative:
        keep[speculative] = 1 + num_accepted(
            tokens, first_logits_row[speculative], [sampling[i].draft_token_ids for i in speculative]
        )
    sampled = {
        s.request_id: tokens[f : f + n].tolist() for s, f, n in zip(sampling, first_logits_row.tolist(), keep.tolist())
    }
    if constrained:
        _advance_grammars(sampling, first_logits_row, sampled,
                          _Redraw(masked, rows, logits.shape[-1], eos_token_ids, result.logprobs))
    logprob_samples = [built.samples[r] for r in result.logprobs.rows.tolist()] if result.logprobs else []
    return RunnerOutput(sampled, result.logprobs, logprob_samples)


def _advance_grammars(sampling: list[ScheduledRequest], first_logits_row: np.ndarray, sampled: dict[str, list[int]],
                      redraw: _Redraw) -> None:
    """Move each grammar over its sample's kept answer tokens (tokens of a thinking section
    are not the grammar's), redrawing a token it refuses."""
    for s, f in zip(sampling, first_logits_row.tolist()):
        state: SamplingState = s.request.sampling
        kept = sampled[s.request_id]
        if s.num_samples > 1 and not s.draft_token_ids:
            if state.reasoning is not None and not state.reasoning.in_answer:
                continue
            for i, matcher in enumerate(state.fork_matchers):
                if matcher is not None:
                    kept[i : i + 1] = redraw.accepted(matcher, kept[i : i + 1], f + i)
                    advance(matcher, kept[i : i + 1])
        elif state.matcher is not None:
            skip = state.reasoning.answer_offset(kept) if state.reasoning is not None else 0
            if skip < len(kept):
                kept[skip:] = redraw.accepted(state.matcher, kept[skip:], f + skip)
                advance(state.matcher, kept[skip:])


@dataclass
class _Redraw:
    """Replaces a sampled token its grammar refuses by a fresh draw from the rest of the row."""

    masked: dict[int, torch.Tensor]  # logits row -> its masked logits, before sampling
    rows: list[SamplingRow]
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    logprobs: LogprobsTensors | None

    def accepted(self, matcher: Matcher, kept: list[int], first_row: int) -> list[int]:
        """`kept` (logits rows first_row ..) cut at its first refused token, which is
        redrawn. If no token of the row is accepted, the refused one is kept last:
        the matcher then fails on it and the request ends (finish_reason "error")."""
        m = matcher.valid_prefix(kept)
        if m == len(kept):
            return kept
        row, refused = first_row + m, kept[m]
        logits = self.masked[row]
        for _ in range(MAX_REDRAWS):
            logits[refused] = float("-inf")
            if logits.max().item() == float("-inf"):
                break
            out = sample(logits.unsqueeze(0).clone(),
                         build_sampling_metadata([self.rows[row]], self.vocab_size, self.eos_token_ids))
            token = int(out.sampled_token_ids[0])
            if matcher.valid_prefix([*kept[:m], token]) == m + 1:
                self._replace_logprobs(row, out.logprobs)
                return [*kept[:m], token]
            refused = token
        logger.warning("structured output: no token continues the grammar after %s (last refused %d)",
                       kept[:m], refused)
        return kept[: m + 1]

    def _replace_logprobs(self, row: int, new: LogprobsTensors | None) -> None:
        if self.logprobs is None or new is None:
            return
        entry = (self.logprobs.rows == row).nonzero().flatten()
        width = new.token_ids.shape[1]
        self.logprobs.token_ids[entry, :width] = new.token_ids
        self.logprobs.logprobs[entry, :width] = new.logprobs
        self.logprobs.sampled_ranks[entry] = new.sampled_ranks
