"""SamplingParams: how one request wants its tokens chosen, validated in one place.

Every check lives in `SamplingParams.__post_init__`, so a request built by the
OpenAI server, the CLI or `LLM.generate()` is rejected the same way, with a
ValueError that names the parameter and its allowed range. Checks that need the
model (token ids against the vocabulary, the engine's logprobs limit) are methods
the engine calls when the request arrives.

This module stays torch-free: the scheduler and simulator import it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .core.validation import is_int
from .structured_output.spec import StructuredOutputs

# Below this temperature the softmax is a one-hot in float32 anyway; sampling
# would only add noise and a division by ~0, so such requests are greedy.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0
# Far above any context length; a budget beyond it is a client's mistake, not a wish.
MAX_THINKING_TOKEN_BUDGET = 10**9

_UINT64 = 1 << 64
# Odd 64-bit constant (2**64 / golden ratio): stepping by it spreads the children
# of nearby request seeds far apart, so request seed s child 1 does not replay
# request seed s+1 child 0 (as a plain seed + i would).
_CHILD_SEED_STRIDE = 0x9E3779B97F4A7C15


def _require_int(name: str, value: object) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _require_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _require_range(name: str, value: float, lo: float, hi: float, allowed: str) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _optional_logprobs(name: str, value: int | None) -> None:
    if value is not None:
        _require_range(name, _require_int(name, value), 0, MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")


def _normalise_stop(stop: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else list(stop)
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {s!r}")
    return strings


def _normalise_token_ids(token_ids: list[int] | tuple[int, ...] | None) -> list[int]:
    ids = [] if token_ids is None else list(token_ids)
    for tid in ids:
        _require_range("stop_token_ids", _require_int("stop_token_ids", tid), 0, math.inf, "a list of token ids >= 0")
    return ids


def _normalise_logit_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    normalised: dict[int, float] = {}
    for key, value in bias.items():
        # JSON object keys arrive as strings ("50256": -100), as OpenAI clients send them.
        token_id = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        _require_range("logit_bias", _require_int("logit_bias", token_id), 0, math.inf, "keyed by token ids >= 0")
        normalised[token_id] = _require_real("logit_bias", value)
        _require_range(
            "logit_bias", normalised[token_id], -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS,
            f"a map of token id -> bias in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
        )
    return normalised


@dataclass(frozen=True)
class ReasoningMarkers:
    end_token_ids: tuple[int, ...]      # the tokens that close the reasoning, e.g. tokenizer.encode("</think>")
    starts_in_reasoning: bool           # True when the prompt already opened the section: the first output token is reasoning
    start_token_ids: tuple[int, ...] = ()  # the tokens that open it in the output (e.g. "<think>"); empty when starts_in_reasoning


def _check_marker_ids(name: str, ids: object, allow_empty: bool) -> None:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)):
        raise ValueError(f"reasoning.{name} must be a tuple of token ids, got {ids!r}")
    if not ids and not allow_empty:
        raise ValueError(f"reasoning.{name} must hold at least one token id")
    for tid in ids:
        _require_range(f"reasoning.{name}", _require_int(f"reasoning.{name}", tid), 0, math.inf, "token ids >= 0")


def _check_reasoning(markers: ReasoningMarkers | None, budget: int | None) -> None:
    """The markers must say where the section opens and how it closes; a budget needs them."""
    if budget is not None:
        _require_range("thinking_token_budget", _require_int("thinking_token_budget", budget), 0,
                       MAX_THINKING_TOKEN_BUDGET, f"None or in [0, {MAX_THINKING_TOKEN_BUDGET}]")
    if markers is None:
        if budget is not None:
            raise ValueError("thinking_token_budget needs reasoning markers (reasoning): the engine must know "
                             "which tokens close the thinking section")
        return
    if not isinstance(markers, ReasoningMarkers):
        raise ValueError(f"reasoning must be a ReasoningMarkers or None, got {type(markers).__name__}")
    if not isinstance(markers.starts_in_reasoning, bool):
        raise ValueError(f"reasoning.starts_in_reasoning must be a bool, got {markers.starts_in_reasoning!r}")
    _check_marker_ids("end_token_ids", markers.end_token_ids, allow_empty=False)
    _check_marker_ids("start_token_ids", markers.start_token_ids, allow_empty=True)
    if markers.starts_in_reasoning and markers.start_token_ids:
        raise ValueError("reasoning.start_token_ids must be empty when starts_in_reasoning is true "
                         "(the prompt already opened the section)")
    if not markers.starts_in_reasoning and not markers.start_token_ids:
        raise ValueError("reasoning.start_token_ids must name the opening tokens when starts_in_reasoning is false")


# Fields beam search does not apply (SamplingParams._check_beam_search): each must keep its default.
_NOT_WITH_BEAM_SEARCH = ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                         "logit_bias", "min_tokens", "stop", "logprobs", "prompt_logprobs", "structured_outputs",
                         "reasoning")


def child_seed(seed: int, index: int) -> int:
    """The generator seed of child `index` of a request with n > 1 and this seed.

    Child 0 keeps the request's seed, so child 0 of an n=4 request replays the
    n=1 request with the same seed. Results lie in [0, 2**64), what
    torch.Generator.manual_seed accepts.
    """
    _require_range("index", _require_int("index", index), 0, math.inf, ">= 0")
    return (_require_int("seed", seed) + index * _CHILD_SEED_STRIDE) % _UINT64


def token_seed(seed: int, position: int) -> int:
    """The generator seed for the output token at `position` of a seeded sample.

    Drawing each token from its own seed makes it a function of (seed, position,
    logits) only: not of how many tokens earlier steps drew, which varies with
    batching and with how many speculative positions a step verified. splitmix64
    keeps neighbouring positions' streams unrelated.
    """
    z = (_require_int("seed", seed) + (position + 1) * 0x9E3779B97F4A7C15) % _UINT64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _UINT64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request; field meanings follow vLLM and the OpenAI API.

    `stop` is normalised to a list, `stop_token_ids` to a list, top_k=-1 to 0
    (both mean off) and an empty `logit_bias` to None, so `dataclasses.replace`
    (which re-runs the checks) and `clone()` are safe on any instance.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: until the context length is reached
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (see StructuredOutputs).
    structured_outputs: StructuredOutputs | None = None
    # Beam search (None: sampling): this many beams, the best n of the finished ones
    # returned, scored as transformers' generate(num_beams=...) does (core/beam_search.py).
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Where the model's thinking section opens and closes (None: no section). The engine
    # then ends the section itself after thinking_token_budget tokens (None: no limit),
    # and structured_outputs constrain only the answer after it (docs/thinking-budget.md).
    reasoning: ReasoningMarkers | None = None
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        _require_range("n", _require_int("n", self.n), 1, math.inf, ">= 1")
        if self.max_tokens is not None:
            _require_range("max_tokens", _require_int("max_tokens", self.max_tokens), 1, math.inf,
                           ">= 1 or None (until the context length)")
        max_min_tokens = math.inf if self.max_tokens is None else self.max_tokens
        _require_range("min_tokens", _require_int("min_tokens", self.min_tokens), 0, max_min_tokens,
                       f"in [0, max_tokens={self.max_tokens}]")
        self.temperature = _require_real("temperature", self.temperature)
        _require_range("temperature", self.temperature, 0.0, math.inf, ">= 0 (0 = greedy)")
        _require_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        _require_range("top_k", self.top_k, 0, math.inf, "0 or -1 (off) or >= 1")
        self.top_p = _require_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.min_p = _require_real("min_p", self.min_p)
        _require_range("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None:
            _require_int("seed", self.seed)
        self.repetition_penalty = _require_real("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _require_real(name, getattr(self, name))
            _require_range(name, value, -MAX_ABS_PENALTY, MAX_ABS_PENALTY,
                           f"in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]")
            setattr(self, name, value)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_token_ids(self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _optional_logprobs("logprobs", self.logprobs)
        _optional_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputs or None, got {type(self.structured_outputs).__name__}"
            )
        _check_reasoning(self.reasoning, self.thinking_token_budget)
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        self.length_penalty = _require_real("length_penalty", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if self.beam_width is None:
            return
        _require_range("beam_width", _require_int("beam_width", self.beam_width), 1, math.inf, ">= 1")
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must be at most beam_width ({self.beam_width}): "
                             "beam search returns the best n of its beams")
        if not self.is_greedy:
            raise ValueError(f"temperature must be 0 with beam search (beams are ranked by the model's log-probabilities), "
                             f"got {self.temperature!r}")
        # Beams are ranked by the model's own log-softmax; settings that change or cut the
        # distribution, per-sequence stop strings and streamed logprobs are not applied.
        defaults = SamplingParams()
        unsupported = [name for name in _NOT_WITH_BEAM_SEARCH if getattr(self, name) != getattr(defaults, name)]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported with beam search (beam_width); leave it unset")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self) -> SamplingParams:
        """A copy that shares no mutable state (stop lists, logit_bias) with this one."""
        return dataclasses.replace(
            self,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
        )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce; the engine calls this on arrival."""
        markers = self.reasoning
        marker_ids = () if markers is None else (*markers.start_token_ids, *markers.end_token_ids)
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids),
                          ("reasoning", marker_ids)):
            for tid in ids:
                if tid >= vocab_size:
                    raise ValueError(f"{name} token id {tid} is out of range [0, {vocab_size - 1}] for this model")

    def verify_max_logprobs(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Reject logprobs / prompt_logprobs above the engine's configured limit."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be at most the engine's max_logprobs={max_logprobs}, got {value}")
