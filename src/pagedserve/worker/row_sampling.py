"""Turning a step's logits into tokens per request: plain rows, parallel-sampling
fork rows (n samples, each with its child's generator) and speculative rows (one
sample per verified position, then the accepted prefix; see spec_decode/verify.py)."""
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


def sample_rows(
    logits: torch.Tensor, sampling: list[ScheduledRequest], first_logits_row: np.ndarray, eos_token_ids: tuple[int, ...] = ()
) -> RunnerOutput:
    """Sample every logits row of a step and verify speculative rows.

    `sampling` holds the step's rows that sample (ScheduledRequests) in order, row i
    owning logits rows first_logits_row[i] .. + num_samples.
    """
    rows: list[SamplingRow] = []
    samples: list[tuple[Request, int]] = []
    # Grammar matcher of each logits row (structured output), and the drafts before it.
    matchers: list[Matcher | None] = []
    drafts_before: list[tuple[int, ...]] = []
    for s in sampling:
        req = s.request
        state: SamplingState = req.sampling
        if s.draft_token_ids:
            # Position j is sampled as if drafts 0 .. j - 1 were already output.
            history = list(req.output_token_ids)
            for j in range(s.num_samples):
                rows.append(SamplingRow(state.params, req.prompt_token_ids, history[:],
                                        _generator(state.seed, len(history))))
                samples.append((req, req.index))
                matchers.append(state.matcher)
                drafts_before.append(s.draft_token_ids[:j])
                if j < len(s.draft_token_ids):
                    history.append(s.draft_token_ids[j])
        elif s.num_samples > 1:
            # A parallel-sampling fork: sample i is drawn with child i's own generator.
            for i in range(s.num_samples):
                rows.append(SamplingRow(state.params, req.prompt_token_ids, req.output_token_ids,
                                        _generator(state.fork_seeds[i], len(req.output_token_ids))))
                samples.append((req, i))
                matchers.append(state.fork_matchers[i])
                drafts_before.append(())
        else:
            rows.append(SamplingRow(state.params, req.prompt_token_ids, req.output_token_ids,
                                    _generator(state.seed, len(req.output_token_ids))))
            samples.append((req, req.index))
            matchers.append(state.matcher)
            drafts_before.append(())
    meta = build_sampling_metadata(rows, logits.shape[-1], eos_token_ids)
    if logits.device.type != "cpu" and not (meta.argmax_only and not any(matchers)):
        # Penalties, filters, seeded draws, grammar masks and logprobs run on the host.
        logits = logits.cpu()
    # Before any other processing, so penalties and filters only see allowed tokens.
    constrained = constrain(logits, matchers, drafts_before)
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
        redraw = _Redraw(masked, rows, logits.shape[-1], eos_token_ids, result.logprobs)
        for s, f in zip(sampling, first_logits_row.tolist()):
            state: SamplingState = s.request.sampling
            kept = sampled[s.request_id]
            if s.num_samples > 1 and not s.draft_token_ids:
                for i, matcher in enumerate(state.fork_matchers):
                    if matcher is not None:
                        kept[i : i + 1] = redraw.accepted(matcher, kept[i : i + 1], f + i)
                        advance(matcher, kept[i : i + 1])
            elif state.matcher is not None:
                kept[:] = redraw.accepted(state.matcher, kept, f)
                advance(state.matcher, kept)
    logprob_samples = [samples[r] for r in result.logprobs.rows.tolist()] if result.logprobs else []
    return RunnerOutput(sampled, result.logprobs, logprob_samples)


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
