"""The step's token budget from a latency target, instead of a fixed number.

A fixed budget trades the two latencies once for all loads: 256 tokens keeps a long
prompt from stalling running streams, but a wave of short prompts arriving together
is then spread over many steps that its first streams sit through as decodes. Here
the budget is chosen every step from a predicted step time:

- with decodes running, add as many prefill tokens as keep the step within the ITL
  target (their inter-token gap is the step's duration);
- with none running, nobody is waiting on a token, so take as many prompt tokens as
  fit the TTFT target: a wave's prompts go in one step;
- never above the hard cap (`max_num_batched_tokens`), and never less than
  `min_chunk` prefill tokens while a prompt waits, so a prompt always advances even
  when the decodes alone exceed the target;
- never less than the supply floor while decodes run: the prompt tokens per step
  that replace the requests the running batch finishes (rows x mean prompt / mean
  output over the requests finished so far), but no more than fills the step to the
  fixed budget's size (PromptSupply). Below it the batch drains to the size whose step
  fits the target, and on a CPU a small batch wastes the weight reads every step
  pays: measured on the engine at W3 (64 clients, 256-token prompts, 128 out), a
  100 ms target without the floor gave 0.65x the fixed budget's throughput (0.72x at
  150 ms) and a 55 s mean TTFT. So under load the target yields to the fixed budget's
  supply, and below that load it holds.

Without a target from the user (and without a fixed --max-num-batched-tokens) the
engine runs the automatic target: a step beside decodes may take AUTO_ITL_RATIO times
the predicted time of those decodes alone, so the light-load tail follows the model
and the machine with no number to choose (designed in the simulator,
benchmarks/auto_budget_sim.py, then measured served: docs/benchmarks.md).

The prediction is affine in what a step carries (StepTimeModel, fitted from the
simulator's calibrated cost model) times a bounded running correction learnt from
the engine's measured step times (StepTimeCorrection). Pure Python: the simulator
and the engine share it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .validation import is_int


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds of one step as a sum of what it carries."""

    fixed_s: float  # an empty step: scheduling, per-layer call costs, a 1-row weight read
    per_token_s: float  # each token through the linear layers, norms and activations
    per_sample_s: float  # each sampled position: the LM head and the sampler
    per_context_token_s: float  # each context token a short query (decode) reads from the cache
    per_pair_s: float  # each causal (query, key) pair of a prefill chunk's attention

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_sample_s", "per_context_token_s", "per_pair_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.per_token_s <= 0:
            raise ValueError(f"per_token_s must be > 0, got {self.per_token_s!r}")

    def seconds(self, tokens: int, samples: int, context_tokens: int, pairs: int) -> float:
        return (self.fixed_s + self.per_token_s * tokens + self.per_sample_s * samples
                + self.per_context_token_s * context_tokens + self.per_pair_s * pairs)

    def decode_seconds(self, rows: int, context_tokens: int) -> float:
        """A step of `rows` decodes (one token and one sample each) over that much context."""
        return self.seconds(rows, rows, context_tokens, 0)


def prefill_pairs(num_tokens: int, context: int) -> int:
    """Causal (query, key) pairs of a chunk of `num_tokens` after `context` computed ones."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


# Rows with fewer new tokens are short queries (decodes, verification rows) that cost
# their context read; longer ones are prefill chunks that cost their pairs, as the
# CPU attention backends split a step.
SHORT_QUERY_LEN = 16


def step_parts(model: StepTimeModel, rows: list[tuple[int, int]], samples: int) -> tuple[float, float]:
    """Predicted seconds of a step whose rows compute n new tokens after c computed ones,
    as (decode part, prefill part): the fixed cost, samples and short queries (their
    tokens and context reads: weight- and cache-bandwidth bound on a CPU) against the
    prefill chunks' tokens and attention pairs (compute bound)."""
    short_tokens = context = prefill_tokens = pairs = 0
    for n, c in rows:
        if n < SHORT_QUERY_LEN:
            short_tokens += n
            context += c + n
        else:
            prefill_tokens += n
            pairs += prefill_pairs(n, c)
    decode = model.seconds(short_tokens, samples, context, 0)
    return decode, model.per_token_s * prefill_tokens + model.per_pair_s * pairs


def predict_step(model: StepTimeModel, rows: list[tuple[int, int]], samples: int) -> float:
    """Seconds of a step whose rows compute n new tokens after c computed ones."""
    return sum(step_parts(model, rows, samples))


# The automatic target's ratio (EngineConfig with neither a target nor a fixed budget):
# chosen in the simulator and measured on the engine, docs/benchmarks.md "fast by default".
AUTO_ITL_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class LatencyTarget:
    itl_s: float | None = None  # p99 inter-token latency to keep while decodes run
    ttft_s: float | None = None  # how long a step may take when no decode is running
    min_chunk: int = 16  # prefill tokens a waiting prompt always gets
    # Without itl_s: a step beside decodes may take this many times the predicted
    # decode-only step of the same batch (the target that needs no number from the user).
    itl_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("itl_s", "ttft_s", "itl_ratio"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        if self.itl_ratio is not None and self.itl_ratio <= 1:
            raise ValueError(f"itl_ratio must be > 1 (the decodes alone take 1), got {self.itl_ratio!r}")
        if not is_int(self.min_chunk) or self.min_chunk < 1:
            raise ValueError(f"min_chunk must be a positive integer, got {self.min_chunk!r}")


def max_prefill_tokens(model: StepTimeModel, seconds: float, base_s: float, context: int) -> int:
    """The most prefill tokens n that a step can add to `base_s` of other work and stay
    within `seconds`: per_token * n + per_pair * (n * context + n (n + 1) / 2) <= seconds - base_s
    (the sample of a completed prompt is in base_s). Solved in closed form, no search."""
    room = seconds - base_s
    if room <= 0:
        return 0
    a = model.per_pair_s / 2
    b = model.per_token_s + model.per_pair_s * (context + 0.5)
    n = room / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
    return max(0, math.floor(n + 1e-9))


def choose_budget(
    model: StepTimeModel,
    target: LatencyTarget,
    cap: int,
    decode_rows: int,
    decode_context: int,
    prefill_context: int = 0,
    decode_scale: float = 1.0,
    prefill_scale: float = 1.0,
    floor: int = 0,
    margin: float = 1.0,
) -> int:
    """The step's token budget: the `decode_rows` decodes (reading `decode_context`
    context tokens in all) plus the prefill tokens the target allows, at most `cap`.

    `prefill_context` is the computed length of the prompt that would be chunked next
    (its chunk attends over it); the scales are the running corrections of the model's
    decode and prefill parts and `margin` how far below the deadline to aim
    (StepTimeCorrection); `floor` is the fewest prefill tokens to allow beside running
    decodes (the supply floor), whatever the target says."""
    base = decode_scale * (model.decode_seconds(decode_rows, decode_context) + model.per_sample_s)
    if not decode_rows:
        deadline = target.ttft_s
    elif target.itl_s is None and target.itl_ratio is not None:
        deadline = target.itl_ratio * base
    else:
        deadline = target.itl_s
    if deadline is None:
        return cap
    deadline /= margin
    scaled = StepTimeModel(0.0, model.per_token_s * prefill_scale, 0.0, 0.0, model.per_pair_s * prefill_scale)
    prefill = max(target.min_chunk, floor if decode_rows else 0,
                  max_prefill_tokens(scaled, deadline, base, prefill_context))
    return max(1, min(cap, decode_rows + prefill))


class PromptSupply:
    """How many prompt tokens per step keep a batch supplied: in steady state `rows`
    decodes finish rows / mean_output requests a step, each replaced by a prompt of
    mean_prompt computed tokens. The rows to supply are the batch the load asks for
    (running plus waiting, up to max_num_seqs), not the batch running now, so a batch
    that starts small grows to it. The means are exponential averages over finished
    requests (aborted ones say nothing about lengths); until the first finishes, the
    caller's expectation stands in (the running requests' prompts and max_tokens), else
    the fixed budget's share. `margin` above 1 lets a batch that fell
    behind refill; the floor never fills a step past `step_tokens` (the fixed budget a
    target replaces), so where the supply asks for more, the step is the fixed budget's."""

    def __init__(self, step_tokens: int, alpha: float = 0.05, margin: float = 1.25):
        if not is_int(step_tokens) or step_tokens < 1:
            raise ValueError(f"step_tokens must be a positive integer, got {step_tokens!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not (math.isfinite(margin) and margin > 0):
            raise ValueError(f"margin must be a finite number > 0, got {margin!r}")
        self.step_tokens, self.alpha, self.margin = step_tokens, alpha, margin
        self.mean_prompt = self.mean_output = 0.0
        self.num_observed = 0

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        if output_tokens < 1 or prompt_tokens < 0:
            return
        a = 1.0 if self.num_observed == 0 else self.alpha
        self.mean_prompt += a * (prompt_tokens - self.mean_prompt)
        self.mean_output += a * (output_tokens - self.mean_output)
        self.num_observed += 1

    def floor(self, decode_rows: int, demand_rows: int, expected: tuple[float, float] | None = None) -> int:
        """Prefill tokens for a step beside `decode_rows` decodes when the load asks for
        a batch of `demand_rows`; `expected` is (mean prompt, mean output) to assume
        while no request has finished."""
        if decode_rows <= 0:
            return 0
        share = max(0, self.step_tokens - decode_rows)
        if self.num_observed:
            prompt, output = self.mean_prompt, self.mean_output
        elif expected is not None and expected[1] > 0:
            prompt, output = expected
        else:
            return share
        return min(math.ceil(self.margin * demand_rows * prompt / output), share)


class StepTimeCorrection:
    """measured / predicted step time, smoothed and bounded, so the model follows the
    machine's drift (another process, a slower hour) but one stalled step cannot swing it.

    Learnt apart for a step's decode part and its prefill part (step_parts), because a
    shared machine's compute and memory speeds drift apart: measured on the engine
    (2026-12-02, 16 streams under a 150 ms target), decode steps ran within 1.1x of the
    calibration while prefill chunks beside them ran 1.6-1.9x slower, and one scale
    that averaged the two let every mixed step overrun the target. A step whose
    prefill is under `decode_share` of its prediction corrects the decode scale; any
    other corrects the prefill scale with what the decode part (at its scale) leaves.
    Each observation's ratio is clipped to within a factor step_bound of the current
    scale before it enters an exponential average (the mean of the first 1 / alpha,
    so a fresh engine learns in a few steps), so a sustained change is followed within
    tens of steps while a single outlier moves it by at most alpha * (step_bound - 1);
    each scale stays within [1/total_bound, total_bound].

    The scales make the prediction right on average; the target is a p99, so `margin`
    also tracks the p90 of measured / corrected prediction (a streaming quantile in log
    space, steps of `tail_step`, within [1, step_bound]) and the budget aims that far
    below the target: measured on W2 (16 streams, 100 ms target), the slowest tenth of
    steps ran 13% over the target with the scales alone."""

    TAIL_QUANTILE = 0.9

    def __init__(self, alpha: float = 0.1, step_bound: float = 2.0, total_bound: float = 4.0,
                 decode_share: float = 0.1, tail_step: float = 0.01):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if step_bound < 1 or total_bound < 1:
            raise ValueError(f"bounds must be >= 1, got {step_bound!r}, {total_bound!r}")
        if not 0 <= decode_share < 1:
            raise ValueError(f"decode_share must be in [0, 1), got {decode_share!r}")
        self.alpha, self.step_bound, self.total_bound, self.decode_share = alpha, step_bound, total_bound, decode_share
        self.decode_scale = self.prefill_scale = 1.0
        self.num_decode = self.num_prefill = 0
        self.tail_step, self._log_margin = tail_step, 0.0

    @property
    def margin(self) -> float:
        """How far below the target the budget aims (>= 1)."""
        return math.exp(self._log_margin)

    @property
    def num_observed(self) -> int:
        return self.num_decode + self.num_prefill

    def observe(self, decode_s: float, prefill_s: float, measured_s: float) -> None:
        """A step predicted as decode_s + prefill_s (unscaled) took measured_s."""
        if not (math.isfinite(measured_s) and measured_s > 0 and decode_s >= 0 and prefill_s >= 0):
            return
        if decode_s + prefill_s <= 0:
            return
        predicted = self.decode_scale * decode_s + self.prefill_scale * prefill_s
        q = self.TAIL_QUANTILE
        above = math.log(measured_s / predicted) > self._log_margin
        self._log_margin += self.tail_step * (q if above else q - 1)
        self._log_margin = min(max(self._log_margin, 0.0), math.log(self.step_bound))
        if prefill_s <= self.decode_share * (decode_s + prefill_s):
            self.decode_scale, self.num_decode = self._update(self.decode_scale, self.num_decode, measured_s / decode_s)
        else:
            ratio = (measured_s - self.decode_scale * decode_s) / prefill_s
            self.prefill_scale, self.num_prefill = self._update(self.prefill_scale, self.num_prefill, ratio)

    def _update(self, scale: float, n: int, ratio: float) -> tuple[float, int]:
        ratio = min(max(ratio, scale / self.step_bound), scale * self.step_bound)
        a = max(self.alpha, 1 / (n + 1))
        scale = (1 - a) * scale + a * ratio
        return min(max(scale, 1 / self.total_bound), self.total_bound), n + 1


class StepBudget:
    """The scheduler's per-step budget under a latency target, learning its correction
    from the step times the engine (or the simulator) reports back."""

    def __init__(self, model: StepTimeModel, target: LatencyTarget, cap: int,
                 correction: StepTimeCorrection | None = None, supply: PromptSupply | None = None):
        """`supply`: the floor under load (None: no floor, the target alone)."""
        if not is_int(cap) or cap < 1:
            raise ValueError(f"cap must be a positive integer, got {cap!r}")
        self.model, self.target, self.cap = model, target, cap
        self.correction = correction or StepTimeCorrection()
        self.supply = supply

    def budget(self, decode_rows: int, decode_context: int, prefill_context: int = 0,
               demand_rows: int | None = None, expected: tuple[float, float] | None = None) -> int:
        """`demand_rows`: the batch the load asks for (default: the decodes running);
        `expected`: (mean prompt, mean output) of the running requests, for the supply
        floor until one finishes."""
        demand = decode_rows if demand_rows is None else demand_rows
        floor = self.supply.floor(decode_rows, demand, expected) if self.supply is not None else 0
        c = self.correction
        return choose_budget(self.model, self.target, self.cap, decode_rows, decode_context, prefill_context,
                             c.decode_scale, c.prefill_scale, floor, c.margin)

    @property
    def wants_expected_lengths(self) -> bool:
        """Whether the supply floor still needs the caller's expectation (nothing finished yet)."""
        return self.supply is not None and self.supply.num_observed == 0

    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request ended normally after computing prompt_tokens of its prompt (prefix
        hits excluded) and producing output_tokens."""
        if self.supply is not None:
            self.supply.observe(prompt_tokens, output_tokens)

    def observe(self, rows: list[tuple[int, int]], samples: int, seconds: float) -> None:
        """A step of these (new tokens, computed before) rows took `seconds`."""
        self.correction.observe(*step_parts(self.model, rows, samples), seconds)
