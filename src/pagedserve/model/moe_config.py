"""The mixture-of-experts hyper-parameters of Mixtral, Qwen3-MoE and OLMoE, from a GGUF's
metadata or a Hugging Face config.json (no torch: the simulator reads configs too).

Each architecture routes the same way (softmax over the router's logits, the top k
experts, each a SwiGLU MLP) and differs in three settings: whether the k probabilities
are renormalised to sum to 1 (Mixtral always; Qwen3-MoE and OLMoE as their config's
`norm_topk_prob` says), each expert's intermediate size (Qwen3-MoE's
`moe_intermediate_size`; the others' `intermediate_size`), and which layers are sparse
(Qwen3-MoE's `decoder_sparse_step` and `mlp_only_layers` leave some dense).

gpt-oss routes and computes otherwise, each a setting here: its router has a bias and
takes the top k logits before a softmax over those k (`softmax_after_top_k`), every expert
matrix has a bias (`biases`), and its experts apply a clamped SwiGLU (`activation`
"clamped_swiglu", with `swiglu_alpha` and `swiglu_limit`; model/moe.py computes it).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

MAX_EXPERTS = 1 << 12  # far above any released MoE (DeepSeek-V3: 256)
MAX_EXPERT_SIZE = 1 << 18
# Each expert's gated activation: SiLU(gate) x up, or gpt-oss's clamped SwiGLU.
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts each token is sent to
    expert_size: int  # each expert's intermediate size
    normalize_top_k: bool  # the k selected probabilities divided by their sum
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts; the others are dense
    softmax_after_top_k: bool = False  # gpt-oss: the top k logits, then a softmax over them
    biases: bool = False  # gpt-oss: a bias on the router and on every expert matrix
    activation: str = "silu"  # EXPERT_ACTIVATIONS
    swiglu_alpha: float | None = None  # clamped_swiglu: glu = gate * sigmoid(alpha * gate)
    swiglu_limit: float | None = None  # clamped_swiglu: gate <= limit, -limit <= up <= limit

    def __post_init__(self) -> None:
        object.__setattr__(self, "sparse_layers", tuple(int(i) for i in self.sparse_layers))
        for name, low, high in (("num_experts", 1, MAX_EXPERTS), ("top_k", 1, self.num_experts),
                                ("expert_size", 1, MAX_EXPERT_SIZE)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation must be one of {EXPERT_ACTIVATIONS}, got {self.activation!r}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if self.activation == "clamped_swiglu" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                        or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite number > 0 for the clamped SwiGLU, got {value!r}")

    def check_layers(self, num_layers: int) -> None:
        bad = [i for i in self.sparse_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"sparse (MoE) layers {bad} are outside the model's {num_layers} layers")

    def active_fraction(self) -> float:
        return self.top_k / self.num_experts


# HF model_type -> (the key of the expert count, of each expert's size, the default of norm_topk_prob).
_HF_KEYS = {
    "mixtral": ("num_local_experts", "intermediate_size", True),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", False),
    "olmoe": ("num_experts", "intermediate_size", False),
    "gpt_oss": ("num_local_experts", "intermediate_size", True),
}


def moe_from_hf(cfg: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The MoE settings of an HF config.json, None for a dense architecture."""
    if arch not in _HF_KEYS:
        return None
    count_key, size_key, norm_default = _HF_KEYS[arch]
    # transformers writes either name for either architecture (its attribute_map).
    experts = int(cfg[count_key] if count_key in cfg else cfg.get("num_local_experts", cfg.get("num_experts")))
    # Mixtral has no norm_topk_prob: it always renormalises.
    normalize = True if arch == "mixtral" else bool(cfg.get("norm_topk_prob", norm_default))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if arch == "gpt_oss":  # a softmax over the k chosen logits sums to 1 by itself
        return MoEConfig(experts, int(cfg["num_experts_per_tok"]), int(cfg[size_key]), True, sparse,
                         softmax_after_top_k=True, biases=True, activation="clamped_swiglu",
                         swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return MoEConfig(experts, int(cfg["num_experts_per_tok"]), int(cfg[size_key]), normalize, sparse)


# GGUF architectures with experts, and llama.cpp's renormalisation where the file does not
# say (its build_moe_ffn calls: llama (Mixtral) and qwen3moe renormalise, olmoe does not).
GGUF_NORMALIZE_DEFAULT = {"llama": True, "qwen3moe": True, "olmoe": False}


def moe_from_gguf(meta: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The MoE settings of a GGUF's metadata (every layer sparse; the loader narrows that to
    the layers whose router tensor the file holds), None without `{arch}.expert_count`."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if experts == 0:
        return None
    size = meta.get(f"{arch}.expert_feed_forward_length") or meta[f"{arch}.feed_forward_length"]
    normalize = meta.get(f"{arch}.expert_weights_norm", GGUF_NORMALIZE_DEFAULT.get(arch, True))
    return MoEConfig(experts, int(meta[f"{arch}.expert_used_count"]), int(size), bool(normalize),
                     tuple(range(num_layers)))


def sparse_layers_in_file(moe: MoEConfig | None, tensor_names: set[str]) -> MoEConfig | None:
    """`moe` with only the layers whose router (`blk.N.ffn_gate_inp.weight`) a GGUF holds as sparse."""
    if moe is None:
        return None
    layers = tuple(i for i in moe.sparse_layers if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    return dataclasses.replace(moe, sparse_layers=layers)
