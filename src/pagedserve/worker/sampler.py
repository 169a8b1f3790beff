"""Batched token sampling: logits of the rows that need a token -> one token id per row.

Per step the model runner calls `build_sampling_metadata` on the rows' SamplingParams
and token histories, then `sample(logits, metadata)`. Processing order (as vLLM):
logit_bias, min_tokens masking, penalties, forced tokens, then temperature, top-k /
top-p / min-p, then the draw. Greedy rows take the argmax after bias, masking and penalties.

Every filter keeps an upper set of the row's logits, so the order of top-k, top-p and
min-p only matters in that top-p is measured on the top-k-renormalised distribution;
min-p compares against the row maximum, which no filter removes.

Random rows use the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. is a
draw from p. It needs no normalisation, so unnormalised exp(logit - max) serves, and
one vectorised noise tensor serves every unseeded row. A seeded row draws its noise
from its own generator, always exactly `vocab_size` uniforms per step indexed by token
id, so its tokens depend on nothing but its own logits and seed: not on the batch, its
position in it, or how ties among candidates happen to be ordered.

n > 1: the runner repeats a request's logits row once per child at the fork point;
each repeated row is then an independent draw. The runner gives a seeded row the
generator `make_generator(token_seed(child_seed(seed, i), t))` for output token t of
sample i, so a token depends on its seed and position only, never on how many
draws came before (batching, preemption and speculative decoding change those).
"""
from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams

# A top-p row without top-k first looks for its nucleus among this many best tokens
# (a partial top-k costs a few percent of a full-vocabulary sort); only a row whose
# nucleus is wider falls back to sorting its whole row.
TOP_P_PROBE = 256

_NEG_INF = float("-inf")


class SamplingRow(NamedTuple):
    """What the runner knows about one row; a plain 4-tuple in this order works too."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None


@dataclass(slots=True)
class RowGroup:
    """Rows of the batch drawn the same way."""

    rows: torch.Tensor  # int64 [G], ascending batch row indices
    seeded: list[tuple[int, torch.Generator]]  # (position within `rows`, that row's generator)


@dataclass(slots=True)
class TokenValues:
    """Sparse (row, token, value) triples, at most one per (row, token)."""

    rows: torch.Tensor  # int64 [N]
    token_ids: torch.Tensor  # int64 [N]
    values: torch.Tensor  # float32 [N]


@dataclass(slots=True)
class TokenMask:
    """Sparse (row, token) pairs whose logits are set to -inf."""

    rows: torch.Tensor  # int64 [N]
    token_ids: torch.Tensor  # int64 [N]


@dataclass(slots=True)
class PenaltyMetadata:
    """Penalties as sparse per-(row, token) entries over the rows' token histories.

    A history holds hundreds of distinct tokens against a vocabulary of ~50k, so the
    builder turns the id lists into a sparse token-count table once (np.unique over
    row * V + token) and folds each row's strengths into it. Applying penalties then
    costs O(distinct history tokens): no padded id tensor, no dense [R, V] counts or
    masks to allocate and sweep each step. Either part is None when no row uses it.
    """

    # Divisor (positive logits) / multiplier (negative ones) on each distinct prompt or
    # output token of rows with repetition_penalty != 1.
    repetition: TokenValues | None
    # frequency_penalty * count + presence_penalty on each distinct output token.
    subtract: TokenValues | None


@dataclass(slots=True)
class SamplingMetadata:
    """Everything `sample` needs for one step, built by `build_sampling_metadata`.

    Per-row tensors carry neutral values on rows a setting does not touch (greedy
    rows: temperature 1, no filters), and a group or sparse table is None when no
    row needs it, so the sampler skips that work entirely.
    """

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor  # float32 [R]; 1.0 on greedy rows
    top_k: torch.Tensor  # int64 [R]; vocab_size where off
    top_p: torch.Tensor  # float32 [R]; 1.0 where off
    min_p: torch.Tensor  # float32 [R]; 0.0 where off
    greedy: RowGroup | None
    # Random rows without top-k / top-p: raced over the whole vocabulary.
    full: RowGroup | None
    # Random rows with top-k and/or top-p: raced over their best candidates only.
    candidates: RowGroup | None
    penalties: PenaltyMetadata | None
    logit_bias: TokenValues | None
    # Stop and EOS ids of rows that have not yet produced min_tokens tokens.
    min_tokens_mask: TokenMask | None
    logprob_rows: torch.Tensor | None  # int64 [L]: rows that asked for logprobs
    max_num_logprobs: int  # top tokens to return per such row (the largest request)
    # Rows that must draw one given token (a thinking budget ending the section): every
    # other logit is -inf at the draw, after the model's logprobs are taken.
    forced: TokenMask | None = None

    @property
    def all_greedy(self) -> bool:
        return self.full is None and self.candidates is None

    @property
    def argmax_only(self) -> bool:
        """Every row greedy with nothing to apply first: sampling is one argmax, which runs on
        whatever device holds the logits (the rest of the sampler runs on CPU tensors)."""
        return (self.all_greedy and self.logit_bias is None and self.min_tokens_mask is None
                and self.penalties is None and self.logprob_rows is None and self.forced is None)

    @property
    def all_random(self) -> bool:
        return self.greedy is None


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs (from the raw logits) of the rows that asked for them.

    Entry j belongs to batch row rows[j]. Column 0 is the sampled token, columns
    1.. the top tokens by descending logprob; a row that asked for m logprobs
    uses columns [0, 1 + m).
    """

    rows: torch.Tensor  # int64 [L]
    token_ids: torch.Tensor  # int64 [L, 1 + max_num_logprobs]
    logprobs: torch.Tensor  # float32 [L, 1 + max_num_logprobs]
    sampled_ranks: torch.Tensor  # int64 [L]: 1 = the most likely token


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [R]
    logprobs: LogprobsTensors | None


def make_generator(seed: int) -> torch.Generator:
    """The per-request generator for a seeded row (any int seed, taken mod 2**64)."""
    return torch.Generator(device="cpu").manual_seed(seed % (1 << 64))


# ----------------------------------------------------------------------------- building


def _group(rows: list[int], generators: dict[int, torch.Generator]) -> RowGroup | None:
    if not rows:
        return None
    seeded = [(pos, generators[row]) for pos, row in enumerate(rows) if row in generators]
    return RowGroup(torch.tensor(rows, dtype=torch.int64), seeded)


def _flat_history(row_ids: list[int], histories: list[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Flat indices row * V + token over the given rows' token histories."""
    lengths = np.fromiter((len(h) for h in histories), dtype=np.int64, count=len(histories))
    tokens = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=int(lengths.sum()))
    return np.repeat(np.asarray(row_ids, dtype=np.int64) * vocab_size, lengths) + tokens


def _token_values(flat: np.ndarray, values: np.ndarray, vocab_size: int) -> TokenValues:
    return TokenValues(
        torch.from_numpy(flat // vocab_size), torch.from_numpy(flat % vocab_size),
        torch.from_numpy(values.astype(np.float32)),
    )


def _build_penalties(rows: Sequence[SamplingRow], vocab_size: int) -> PenaltyMetadata | None:
    params = [row[0] for row in rows]
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    additive = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not repeated and not additive:
        return None
    repetition = subtract = None
    if repeated:
        flat = np.unique(np.concatenate([
            _flat_history(repeated, [rows[i][1] for i in repeated], vocab_size),
            _flat_history(repeated, [rows[i][2] for i in repeated], vocab_size),
        ]))
        per_row = np.array([p.repetition_penalty for p in params])
        repetition = _token_values(flat, per_row[flat // vocab_size], vocab_size)
    if additive:
        flat, counts = np.unique(
            _flat_history(additive, [rows[i][2] for i in additive], vocab_size), return_counts=True
        )
        owner = flat // vocab_size
        frequency = np.array([p.frequency_penalty for p in params])
        presence = np.array([p.presence_penalty for p in params])
        subtract = _token_values(flat, frequency[owner] * counts + presence[owner], vocab_size)
    return PenaltyMetadata(repetition, subtract)


def _sparse_rows(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    return table[:, 0].contiguous(), table[:, 1].contiguous()


def build_sampling_metadata(
    rows: Sequence[SamplingRow | tuple[SamplingParams, Sequence[int], Sequence[int], torch.Generator | None]],
    vocab_size: int,
    eos_token_ids: Collection[int] = (),
    forced: Sequence[tuple[int, int]] = (),
) -> SamplingMetadata:
    """One step's SamplingMetadata from (params, prompt ids, output ids, generator) per row.

    A seeded random row must come with its generator (`make_generator(seed)` once per
    request, kept by the runner across steps); a greedy row's generator is ignored.
    `eos_token_ids` are masked, with the row's stop_token_ids, until min_tokens is
    reached, except on ignore_eos rows. `forced` holds (row, token id) pairs: those rows
    draw that token whatever their logits say.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    temperature: list[float] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    greedy: list[int] = []
    full: list[int] = []
    candidates: list[int] = []
    generators: dict[int, torch.Generator] = {}
    bias: list[tuple[int, int]] = []
    bias_values: list[float] = []
    masked: list[tuple[int, int]] = []
    logprob_rows: list[int] = []
    max_num_logprobs = 0
    for i, (params, _, output_ids, generator) in enumerate(rows):
        if params.is_greedy:
            greedy.append(i)
            temperature.append(1.0)
            top_k.append(vocab_size)
            top_p.append(1.0)
            min_p.append(0.0)
        else:
            if params.seed is not None and generator is None:
                raise ValueError(f"generator: row {i} has seed={params.seed} but no generator")
            if generator is not None:
                generators[i] = generator
            k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
            (candidates if k < vocab_size or params.top_p < 1.0 else full).append(i)
            temperature.append(params.temperature)
            top_k.append(k)
            top_p.append(params.top_p)
            min_p.append(params.min_p)
        if params.logit_bias:
            bias.extend((i, tid) for tid in params.logit_bias)
            bias_values.extend(params.logit_bias.values())
        if len(output_ids) < params.min_tokens:
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids.update(eos_token_ids)
            masked.extend((i, tid) for tid in sorted(stop_ids))
        if params.logprobs is not None:
            logprob_rows.append(i)
            max_num_logprobs = max(max_num_logprobs, params.logprobs)
    return SamplingMetadata(
        num_rows=len(rows),
        vocab_size=vocab_size,
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        min_p=torch.tensor(min_p, dtype=torch.float32),
        greedy=_group(greedy, generators),
        full=_group(full, generators),
        candidates=_group(candidates, generators),
        penalties=_build_penalties(rows, vocab_size),
        logit_bias=TokenValues(*_sparse_rows(bias), torch.tensor(bias_values, dtype=torch.float32)) if bias else None,
        min_tokens_mask=TokenMask(*_sparse_rows(masked)) if masked else None,
        logprob_rows=torch.tensor(logprob_rows, dtype=torch.int64) if logprob_rows else None,
        max_num_logprobs=max_num_logprobs,
        forced=TokenMask(*_sparse_rows(list(forced))) if forced else None,
    )


# ----------------------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """Draw one token per row. `logits` (float32 [R, V]) is consumed: modified in place."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"logits must be a float32 [rows, vocab] tensor, got {logits.dtype} {tuple(logits.shape)}")
    if tuple(logits.shape) != (metadata.num_rows, metadata.vocab_size):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match the metadata's "
            f"({metadata.num_rows}, {metadata.vocab_size})"
        )
    # Logprobs report the model's own distribution, so take them before any processing.
    raw_logprobs = None
    if metadata.logprob_rows is not None:
        raw_logprobs = _take_rows(logits, metadata.logprob_rows).log_softmax(dim=-1)
    if metadata.logit_bias is not None:
        bias = metadata.logit_bias
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if metadata.min_tokens_mask is not None:
        mask = metadata.min_tokens_mask
        logits.index_put_((mask.rows, mask.token_ids), torch.tensor(_NEG_INF))
    if metadata.penalties is not None:
        apply_penalties(logits, metadata.penalties)
    if metadata.forced is not None:
        # After every other change, so nothing (a min_tokens mask) can leave such a row all -inf.
        forced = metadata.forced
        logits[forced.rows] = _NEG_INF
        logits[forced.rows, forced.token_ids] = 0.0
    sampled = _draw(logits, metadata)
    logprobs = None
    if raw_logprobs is not None:
        rows = metadata.logprob_rows
        logprobs = gather_logprobs(raw_logprobs, sampled[rows], rows, metadata.max_num_logprobs)
    return SamplerOutput(sampled, logprobs)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> None:
    """In place: repetition on prompt + output tokens, then presence / frequency on output tokens."""
    if penalties.repetition is not None:
        rep = penalties.repetition
        seen = (rep.rows, rep.token_ids)
        old = logits[seen]
        # Dividing a positive logit and multiplying a negative one both push it down.
        logits[seen] = torch.where(old > 0, old / rep.values, old * rep.values)
    if penalties.subtract is not None:
        sub = penalties.subtract
        logits.index_put_((sub.rows, sub.token_ids), sub.values.neg(), accumulate=True)


def _take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Group rows are ascending and unique, so a group as large as the batch is all of it.
    return x if rows.numel() == x.shape[0] else x[rows]


def _draw(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.all_greedy:
        return logits.argmax(dim=-1)
    sampled = torch.empty(md.num_rows, dtype=torch.int64)
    if not md.all_random:
        sampled[md.greedy.rows] = _take_rows(logits, md.greedy.rows).argmax(dim=-1)
    if md.full is not None:
        rows = md.full.rows
        sampled[rows] = _race_full(
            _take_rows(logits, rows), md.temperature[rows], md.min_p[rows], md.full.seeded
        )
    if md.candidates is not None:
        rows = md.candidates.rows
        sampled[rows] = _race_candidates(
            _take_rows(logits, rows), md.temperature[rows], md.top_k[rows], md.top_p[rows], md.min_p[rows],
            md.candidates.seeded,
        )
    return sampled


def _exp_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise in place from U[0, 1) (faster than Tensor.exponential_ on CPU).

    U < 1 keeps the noise > 0, so masked tokens (score 0) score 0, never NaN.
    """
    return uniform.log_().neg_()


def _race_full(
    x: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, seeded: list[tuple[int, torch.Generator]]
) -> torch.Tensor:
    """Sample over the whole vocabulary, with only temperature and min-p applied.

    `x` is overwritten: it is either the consumed logits or a copy of some of their rows.
    """
    scores = x.div_(temperature.unsqueeze(1))
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # probabilities relative to the row's best
    if bool((min_p > 0).any()):
        scores.masked_fill_(scores < min_p.unsqueeze(1), 0.0)
    uniform = torch.rand(x.shape)
    for pos, generator in seeded:
        uniform[pos] = torch.rand(x.shape[1], generator=generator)
    return scores.div_(_exp_noise(uniform)).argmax(dim=-1)


def _race_candidates(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeded: list[tuple[int, torch.Generator]],
) -> torch.Tensor:
    """Sample rows with top-k and/or top-p among their best tokens, without a full sort."""
    vocab_size = x.shape[1]
    top_p_only = top_k >= vocab_size  # every row here has top-k or top-p
    budget = torch.where(top_p_only, min(TOP_P_PROBE, vocab_size), top_k)
    values, token_ids = x.topk(int(budget.max()), dim=-1)
    # The same full-vocabulary draw whichever path a seeded row ends up on.
    seeded_uniform = {pos: torch.rand(vocab_size, generator=generator) for pos, generator in seeded}
    full_log_z = torch.zeros(x.shape[0])
    if bool(top_p_only.any()):
        only = top_p_only.nonzero().squeeze(1)
        full_log_z[only] = _log_normaliser(x[only].div_(temperature[only].unsqueeze(1)))
    tokens, spilled = _race_sorted(
        values, token_ids, budget, temperature, top_p, min_p, top_p_only, full_log_z, seeded_uniform
    )
    if bool(spilled.any()):
        spill = spilled.nonzero().squeeze(1)
        spill_list = spill.tolist()
        values, token_ids = x[spill].sort(dim=-1, descending=True)
        tokens[spill] = _race_sorted(
            values, token_ids, torch.full((len(spill_list),), vocab_size), temperature[spill], top_p[spill],
            min_p[spill], top_p_only[spill], full_log_z[spill],
            {j: seeded_uniform[pos] for j, pos in enumerate(spill_list) if pos in seeded_uniform},
        )[0]
    return tokens


def _log_normaliser(scaled: torch.Tensor) -> torch.Tensor:
    """logsumexp over each row, computed in place in `scaled` (a scratch copy) to spare temporaries."""
    row_max = scaled.amax(dim=-1, keepdim=True)
    return scaled.sub_(row_max).exp_().sum(dim=-1).log_().add_(row_max.squeeze(1))


def _race_sorted(
    values: torch.Tensor,
    token_ids: torch.Tensor,
    budget: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    top_p_only: torch.Tensor,
    full_log_z: torch.Tensor,
    seeded_uniform: dict[int, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Race over each row's first `budget` candidates (logits sorted descending).

    Top-k rows normalise over their k candidates; top-p-only rows over their whole
    row (`full_log_z`), and report `spilled` when the candidates hold less mass than
    top_p, i.e. the nucleus reaches past them and the row must be redone sorted in full.
    """
    num_candidates = values.shape[1]
    scaled = values / temperature.unsqueeze(1)
    keep = torch.arange(num_candidates).unsqueeze(0) < budget.unsqueeze(1)
    scaled.masked_fill_(~keep, _NEG_INF)
    spilled = torch.zeros(values.shape[0], dtype=torch.bool)
    wants_top_p = top_p < 1.0
    if bool(wants_top_p.any()):
        log_z = torch.where(top_p_only, full_log_z, scaled.logsumexp(dim=-1))
        probs = (scaled - log_z.unsqueeze(1)).exp_()
        cumulative = probs.cumsum(dim=-1)
        # A token stays while the mass strictly above it is short of top_p; the first always stays.
        keep &= ((cumulative - probs) < top_p.unsqueeze(1)) | ~wants_top_p.unsqueeze(1)
        spilled = top_p_only & wants_top_p & (cumulative[:, -1] < top_p)
    top = scaled[:, :1]
    keep &= scaled >= top + min_p.log().unsqueeze(1)
    scores = (scaled - top).exp_().masked_fill_(~keep, 0.0)
    uniform = torch.rand(values.shape)
    for pos, row_uniform in seeded_uniform.items():
        uniform[pos] = row_uniform[token_ids[pos]]
    choice = scores.div_(_exp_noise(uniform)).argmax(dim=-1, keepdim=True)
    return token_ids.gather(1, choice).squeeze(1), spilled


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, rows: torch.Tensor, num_top: int
) -> LogprobsTensors:
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))
    # Rank counts every token at least as likely, so ties share the worse rank (as vLLM).
    ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)
    token_ids, logprobs = sampled.unsqueeze(1), sampled_logprobs
    if num_top > 0:
        top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        logprobs = torch.cat([logprobs, top_logprobs], dim=1)
    return LogprobsTensors(rows, token_ids, logprobs, ranks)
