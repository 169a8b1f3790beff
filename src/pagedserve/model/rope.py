"""RoPE scaling: the types pagedserve implements, read from config.json (`rope_scaling`, or
transformers' newer `rope_parameters`) or GGUF metadata, and the one place their frequencies
and their scale on cos and sin are computed, as transformers' modeling_rope_utils computes them.

ModelConfig.rope_scaling holds the normalised dict: `rope_type` one of ROPE_KEYS, with only
the keys ROPE_KEYS names for it. A type or a key outside them is refused by name: each of
them changes the arithmetic.

- linear: every frequency divided by `factor`.
- dynamic (NTK): transformers rescales the base with the longest sequence of the current
  forward, so keys already cached were rotated at other frequencies than the ones the batch
  would get; below `max_position_embeddings` it is plain RoPE. pagedserve serves it there,
  exactly, and refuses a position past it (the engine's max_model_len never exceeds it).
- yarn: frequencies blended between interpolated and original by a ramp over the dims
  (`beta_fast`, `beta_slow`, `truncate`), cos and sin scaled by `attention_factor` (from
  `mscale` / `mscale_all_dim` or `factor` when not given).
- llama3: long wavelengths divided by `factor`, short ones kept, the band between smoothed.
- longrope (Phi-3/4): transformers switches a whole sequence to the long factors once it
  passes `original_max_position_embeddings`; pagedserve serves at that context with the short
  factors (model/variants.py says why).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # model/config.py imports this module, and sim/ reads configs without torch
    import torch

# Keys each type reads besides rope_type. `max_position_embeddings` (longrope) is the context
# the config names, kept for the default attention factor after max_position_embeddings is capped.
ROPE_KEYS: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "longrope": frozenset({"short_factor", "long_factor", "factor", "attention_factor",
                           "original_max_position_embeddings", "max_position_embeddings"}),
}
_ALIASES = {"su": "longrope"}
# Keys config.json's RoPE dict carries that ModelConfig holds elsewhere (rope_theta,
# partial_rotary_factor: read by the config loader) or that only name the type.
_ELSEWHERE = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_NEEDS_ORIGINAL = ("yarn", "llama3", "longrope")


def params(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's RoPE dict as transformers takes it: `rope_scaling` (the older form) over
    `rope_parameters`; either may carry rope_theta and partial_rotary_factor, which win
    over the top-level fields."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def scaling_type(rs: dict[str, Any] | None) -> str | None:
    """The type of a RoPE dict (None or "default": no scaling)."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    return None if kind == "default" else _ALIASES.get(kind, kind)


def check_scaling(rs: dict[str, Any] | None) -> None:
    """ValueError naming the type or key of `rs` that pagedserve does not implement."""
    kind = scaling_type(rs)
    if kind is None:
        return
    if kind not in ROPE_KEYS:
        raise ValueError(f"rope_scaling.rope_type {kind!r} is not implemented (implemented: {', '.join(ROPE_KEYS)})")
    for key in sorted(set(rs) - ROPE_KEYS[kind] - _ELSEWHERE):
        raise ValueError(f"rope_scaling.{key}={rs[key]!r} is not implemented for rope_type {kind!r}")
    if kind in _NEEDS_ORIGINAL and not rs.get("original_max_position_embeddings"):
        raise ValueError(f"rope_scaling.original_max_position_embeddings is required for rope_type {kind!r}")


def hf_fields(cfg: dict[str, Any], rope: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """ModelConfig's rope_scaling (and max_position_embeddings, which longrope caps) from
    config.json `cfg` and its RoPE dict `rope` (params(cfg), or one layer type's)."""
    kind = scaling_type(rope)
    if kind is None:
        return {"rope_scaling": None}
    out = {k: v for k, v in rope.items() if k not in _ELSEWHERE}
    out["rope_type"] = kind
    if kind in _NEEDS_ORIGINAL:
        # transformers: a top-level original_max_position_embeddings (Phi-3 writes one) wins.
        out["original_max_position_embeddings"] = int(cfg.get("original_max_position_embeddings")
                                                      or out.get("original_max_position_embeddings") or max_positions)
    fields: dict[str, Any] = {"rope_scaling": out}
    if kind == "yarn" and out.get("factor") is None:
        out["factor"] = max_positions / out["original_max_position_embeddings"]
    if kind == "longrope":
        out["max_position_embeddings"] = max_positions
        fields["max_position_embeddings"] = min(out["original_max_position_embeddings"], max_positions)
    check_scaling(out)
    return fields


def gguf_fields(get: Callable[..., Any], arch: str) -> dict[str, Any]:
    """ModelConfig's rope_scaling from a GGUF's `{arch}.rope.scaling.*` metadata (`get(key)`).

    A llama3 file carries its divisors as the rope_freqs tensor instead, a Phi-3 file its
    LongRoPE factors as tensors (model/variants.py), so neither has a type here. YaRN's
    `yarn_attn_factor` is read as transformers' attention_factor, which llama.cpp's converter
    writes there."""
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if kind is None and factor and factor != 1:  # Gemma 3's converter writes the factor alone
        kind = "linear"
    # Values that leave the arithmetic alone; any other changes it. Phi-3's LongRoPE reads
    # attn_factor (model/variants.py); elsewhere llama.cpp multiplies cos and sin by it.
    neutral = {"rope.scaling.alpha": (None, 0), "rope.scaling.yarn_log_multiplier": (None, 0)}
    if arch != "phi3":
        neutral["rope.scaling.attn_factor"] = (None, 1)
    for key, values in neutral.items():
        if get(key) not in values:
            raise ValueError(f"GGUF {arch}.{key}={get(key)!r} is not implemented")
    if kind in (None, "none") or (arch == "phi3" and kind == "longrope"):
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind != "yarn":
        raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not implemented (implemented: linear, yarn)")
    ext = get("rope.scaling.yarn_ext_factor")
    if ext is not None and ext != 1:
        raise ValueError(f"GGUF {arch}.rope.scaling.yarn_ext_factor={ext!r} is not implemented (only 1, YaRN's)")
    original = get("rope.scaling.original_context_length")
    if not original:
        raise ValueError(f"GGUF {arch}.rope.scaling.original_context_length is required for YaRN")
    rs: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for key, ours in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                      ("yarn_beta_slow", "beta_slow")):
        if get(f"rope.scaling.{key}") is not None:
            rs[ours] = float(get(f"rope.scaling.{key}"))
    check_scaling(rs)
    return {"rope_scaling": rs}


def freq_divisors(config: Any) -> torch.Tensor | None:
    """What each of RoPE's frequencies is divided by under `config.rope_scaling` (one per
    rotated pair of dims, the default frequencies base ** (-2i / dim) divided by them give
    transformers' inv_freq); None where they are all ones."""
    import torch

    rs, dim = config.rope_scaling, config.rotary_dim
    kind = scaling_type(rs)
    if kind == "linear":
        return torch.full((dim // 2,), float(rs["factor"]))
    if kind == "longrope":
        factors = torch.tensor(rs["short_factor"], dtype=torch.float32)
        if factors.shape != (dim // 2,):
            raise ValueError(f"rope_scaling.short_factor has {factors.numel()} entries; "
                             f"RoPE turns {dim} dims (needs {dim // 2})")
        return factors
    if kind not in ("llama3", "yarn"):
        return None
    inv_freq = default_inv_freq(config.rope_theta, dim)
    scaled = _llama3(rs, inv_freq) if kind == "llama3" else _yarn(rs, inv_freq, config.rope_theta, dim)
    return (inv_freq / scaled).float()


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Unscaled RoPE frequencies of a `dim`-dim rotation, in fp64."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3(rs: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    import torch

    factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, smoothed)
    return torch.where(wavelen < old_ctx / high, inv_freq, scaled)


def _yarn(rs: dict[str, Any], inv_freq: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
    import torch

    factor, original = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1  # transformers' `or`

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(config: Any) -> float:
    """The scale on cos and sin (so on every attention score, squared) that yarn and longrope
    apply: the config's `attention_factor`, else transformers' default from the factor."""
    rs = config.rope_scaling
    kind = scaling_type(rs)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    original = rs["original_max_position_embeddings"]
    if kind == "longrope":
        factor = rs.get("factor") or rs["max_position_embeddings"] / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return yarn_mscale(rs["factor"], rs["mscale"]) / yarn_mscale(rs["factor"], rs["mscale_all_dim"])
    return yarn_mscale(rs["factor"])


def position_limit(config: Any) -> int | None:
    """The first position this scaling cannot rotate exactly (dynamic NTK: see the module
    docstring); None where every position can be."""
    return config.max_position_embeddings if scaling_type(config.rope_scaling) == "dynamic" else None
