"""Phi-3/4 and Gemma 2/3 beside the Llama family: their config.json and GGUF metadata read
into ModelConfig's fields, and what those fields mean.

- `sliding_window` (Mistral, Mixtral, Qwen2/3 under use_sliding_window, Phi-3/4, Gemma 2/3):
  a sliding layer's query sees the keys less than this many positions before it, its own
  included (HF's `kv_idx > q_idx - window`).
  `sliding_layers` says which layers slide (None: all of them). Every layer keeps its
  whole K/V in the paged cache; the window only masks (attention/backend.py). So prefix
  caching, copy-on-write and preemption see the blocks of a Llama model, as vLLM keeps
  full blocks for such models unless its hybrid allocator is on.
- `attn_logit_softcapping` / `final_logit_softcapping` (Gemma 2): scores and logits capped
  as cap * tanh(x / cap).
- `query_pre_attn_scalar` (Gemma): the attention scale is its inverse square root.
- `rope_local_theta` (Gemma 3): the RoPE base of the sliding layers (the global ones take
  `rope_theta`, with `rope_scaling`).
- `partial_rotary_factor` (Phi-3/4): RoPE turns the first head_dim * factor dims of a head.
- gpt-oss: `layer_types` says which layers slide (by default every other one from the first),
  `attention_bias` biases q, k, v and o, and every layer has attention sinks (docs/gpt-oss.md).
  An MXFP4 checkpoint (`quantization_config`) is refused: its experts are not read yet.

Phi-3/4's LongRoPE (model/rope.py computes it) switches a whole sequence to other
frequencies once it grows past the original context, which a cache of keys rotated at the
old ones cannot follow: pagedserve serves such a model at its original context with the short factors (`max_position_embeddings`
becomes `original_max_position_embeddings`), which is what transformers computes below it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import rope

if TYPE_CHECKING:  # model/config.py imports this module, and sim/ reads configs without torch
    import torch

ARCHITECTURES = ("phi3", "gemma2", "gemma3", "gpt_oss")
GEMMA = ("gemma2", "gemma3")
# HF model_type -> the architecture name GGUF files use.
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
# Gemma's MLP: HF's "gelu_pytorch_tanh" (GELU's tanh approximation) is the one it ships.
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def layer_window(config: Any, index: int) -> int:
    if not config.sliding_window or (config.sliding_layers is not None and not config.sliding_layers[index]):
        return 0
    return config.sliding_window


def check_fields(config: Any) -> None:
    """ValueError naming the field for a value these architectures' fields cannot take;
    sliding_layers read back from JSON (a list) becomes a tuple."""
    if config.sliding_layers is not None:
        object.__setattr__(config, "sliding_layers", tuple(bool(x) for x in config.sliding_layers))
        if len(config.sliding_layers) != config.num_layers:
            raise ValueError(f"sliding_layers has {len(config.sliding_layers)} entries for {config.num_layers} layers")
    window = config.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "rope_local_theta"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a finite number > 0 or null, got {value!r}")
    factor = config.partial_rotary_factor
    if not 0 < factor <= 1 or int(config.head_dim * factor) % 2:
        raise ValueError(f"partial_rotary_factor must be in (0, 1] and rotate an even number of dims, got {factor!r}")


def hf_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields that config.json gives these architectures (overriding the Llama reading)."""
    reader = _HF_READERS.get(arch)
    return reader(cfg) if reader is not None else {}


def _window(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None}


def _qwen_window(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """transformers windows Qwen2/3(-MoE) only under use_sliding_window: Qwen2/3 the layers
    `layer_types` calls sliding (by default those from max_window_layers on), Qwen3-MoE all."""
    window, use = cfg.get("sliding_window"), cfg.get("use_sliding_window")
    types, first = cfg.get("layer_types"), int(cfg.get("max_window_layers", 28))
    if not (use and window):
        return {"sliding_window": None}
    if arch == "qwen3_moe":
        return {"sliding_window": int(window)}
    layers = int(cfg["num_hidden_layers"])
    types = types or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {"sliding_window": int(window), "sliding_layers": tuple(t == "sliding_attention" for t in types)}


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    factor = rope.params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return {**_window(cfg), "partial_rotary_factor": float(factor)}


def _gemma(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    if "text_config" in cfg:
        raise ValueError("a multimodal Gemma 3 checkpoint is not served; use a text-only one (Gemma3ForCausalLM)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported for {arch} (supported: {GEMMA_ACTIVATIONS})")
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        sliding = tuple(t == "sliding_attention" for t in cfg["layer_types"])
    elif arch == "gemma2":
        sliding = tuple(i % 2 == 0 for i in range(layers))
    else:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        sliding = tuple((i + 1) % pattern != 0 for i in range(layers))
    params = rope.params(cfg)
    full, local = params.get("full_attention", params), params.get("sliding_attention", {})
    # The sliding layers' rotary takes the global one's attention factor: only linear scaling,
    # which has none, is served.
    scaling = rope.hf_fields(cfg, full, int(cfg.get("max_position_embeddings", 4096)))["rope_scaling"]
    if rope.scaling_type(scaling) not in (None, "linear"):
        raise ValueError(f"rope_scaling type {rope.scaling_type(scaling)!r} is not implemented for {arch} "
                         "(implemented: linear)")
    fields = {
        **_window(cfg), "sliding_layers": sliding, "rope_scaling": scaling,
        "rope_theta": float(full.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }
    if arch == "gemma3":
        fields["rope_local_theta"] = float(cfg.get("rope_local_base_freq", local.get("rope_theta", 10000.0)))
    return fields


LAYER_TYPES = ("sliding_attention", "full_attention")


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config (quant_method {method!r}) is not implemented for gpt_oss; "
                         "load a checkpoint whose experts are float tensors")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not implemented for gpt_oss (implemented: {LAYER_TYPES})")
    bias = bool(cfg.get("attention_bias", True))
    return {**_window(cfg), "sliding_layers": tuple(t == "sliding_attention" for t in types),
            "attention_bias": bias, "o_bias": bias, "attention_sinks": True}


_HF_READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "mistral": _window,
    "mixtral": _window,
    "qwen2": lambda cfg: _qwen_window(cfg, "qwen2"),
    "qwen3": lambda cfg: _qwen_window(cfg, "qwen3"),
    "qwen3_moe": lambda cfg: _qwen_window(cfg, "qwen3_moe"),
    "phi3": _phi3,
    "gemma2": lambda cfg: _gemma(cfg, "gemma2"),
    "gemma3": lambda cfg: _gemma(cfg, "gemma3"),
    "gpt_oss": _gpt_oss,
}


def gguf_fields(arch: str, get: Callable[..., Any]) -> dict[str, Any]:
    """ModelConfig fields from a GGUF's `{arch}.*` metadata (`get(key, default)`), as llama.cpp
    reads them: Gemma's sliding pattern, local RoPE base and attention scale are fixed there."""
    if arch == "phi3":
        return _phi3_gguf(get)
    if arch not in GEMMA:
        return {}
    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    # llama.cpp scales the 27B models (46 layers for Gemma 2, 62 for Gemma 3) by hidden / heads.
    big = layers == (46 if arch == "gemma2" else 62)
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # llama.cpp's per-layer flags, where a file has them
        sliding = tuple(bool(x) for x in pattern)
    elif arch == "gemma2":
        sliding = tuple(i % 2 == 0 for i in range(layers))
    else:
        sliding = tuple((i + 1) % int(pattern or 6) != 0 for i in range(layers))
    fields = {
        "sliding_window": int(get("attention.sliding_window")), "sliding_layers": sliding,
        "attn_logit_softcapping": get("attn_logit_softcapping"), "final_logit_softcapping": get("final_logit_softcapping"),
        "query_pre_attn_scalar": float(get("attention.scale")) ** -2 if get("attention.scale")
        else float(hidden // heads if big else head_dim),
    }
    if arch == "gemma3":
        fields["rope_local_theta"] = 10000.0
    return fields


# GGUF tensor names (llama.cpp's) whose HF names differ from the Llama family's.
_GEMMA_LAYER_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
GGUF_LAYER_NAMES = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES,
                    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# Phi-3's LongRoPE factors: the short ones are the frequency divisors; the long ones go
# unused, at the original context (module docstring).
GGUF_GLOBAL_NAMES = {"phi3": {"rope_factors_short.weight": "rope_freqs",
                              "rope_factors_long.weight": "rope_factors_long"}}


def gguf_norm_offset(arch: str, hf_name: str) -> bool:
    """Whether a GGUF tensor holds Gemma's norm as 1 + weight (llama.cpp's converter adds
    the 1): the loader takes it back to HF's weight, and gemma_norms adds it again."""
    return arch in GEMMA and hf_name.endswith("norm.weight")


def gemma_norms(sd: dict[str, Any], hf: dict[str, torch.Tensor], config: Any) -> None:
    """Gemma's four norms a layer into the fused state `sd` (in place), every norm weight
    as the multiplier 1 + weight that Gemma's RMSNorm applies."""
    if config.architecture not in GEMMA:
        return
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        sd[f"layers.{i}.ffn_norm.weight"] = hf[p + "pre_feedforward_layernorm.weight"]
        sd[f"layers.{i}.post_attn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[f"layers.{i}.post_ffn_norm.weight"] = hf[p + "post_feedforward_layernorm.weight"]
    for name in [n for n in sd if n.endswith("norm.weight")]:
        sd[name] = sd[name].float() + 1.0


def _phi3_gguf(get: Callable[..., Any]) -> dict[str, Any]:
    rot = get("rope.dimension_count")
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // int(get("attention.head_count"))))
    fields = {"sliding_window": int(get("attention.sliding_window")) if get("attention.sliding_window") else None,
              "partial_rotary_factor": int(rot) / head_dim if rot else 1.0}
    original = get("rope.scaling.original_context_length")
    if original:  # LongRoPE: its short factors arrive as the rope_factors_short tensor
        context = int(get("context_length", original))
        fields["max_position_embeddings"] = min(int(original), context)
        fields["rope_scaling"] = {"rope_type": "longrope", "attention_factor": get("rope.scaling.attn_factor"),
                                  "original_max_position_embeddings": int(original), "max_position_embeddings": context}
    return fields
