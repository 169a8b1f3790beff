"""Beam search at the engine's edges: a request's beam group on the way in, its best
hypotheses as SampleDeltas on the way out (whole, at the end: beams are not streamed)."""
from __future__ import annotations

from collections.abc import Sequence

from ..core.beam_search import BeamGroup
from ..model.tokenizer import Tokenizer
from ..outputs import SampleDelta
from ..sampling_params import SamplingParams
from ..sampling_state import SamplingState
from .detokenizer import IncrementalDetokenizer


def beam_group(params: SamplingParams, max_tokens: int, stop_token_ids: frozenset[int],
               eos_token_id: int | None) -> BeamGroup:
    """The group of a beam-search request; its stop tokens are the ones that would end a sample."""
    stops = stop_token_ids | ({eos_token_id} if eos_token_id is not None and not params.ignore_eos else set())
    return BeamGroup(params.beam_width, max_tokens, params.length_penalty, params.early_stopping, frozenset(stops))


def beam_sampling_state(params: SamplingParams) -> SamplingState:
    """Every member samples nothing (the group chooses), so no seeds and no matchers."""
    return SamplingState(params, None, [None] * params.beam_width, None, [None] * params.beam_width)


def beam_samples(group: BeamGroup, params: SamplingParams, tokenizer: Tokenizer,
                 prompt_token_ids: Sequence[int]) -> list[tuple[SampleDelta, IncrementalDetokenizer]]:
    """The best n hypotheses, best first, each whole in its delta (its only one)."""
    outs = []
    for index, hypothesis in enumerate(group.best(params.n)):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        ids = tuple(hypothesis.token_ids)
        text = detokenizer.update(list(ids))[0] + detokenizer.finish()
        outs.append((SampleDelta(index, text, ids, None, hypothesis.finish_reason, None), detokenizer))
    return outs
