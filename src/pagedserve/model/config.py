"""Architecture hyper-parameters of a Llama-family model, from GGUF metadata or config.json.

One config (and one model file) covers Llama, Mistral, Qwen2 and Qwen3: they differ
only in flags (q/k/v bias, q/k RMSNorm, RoPE scaling, tied head). Phi-3/4 and Gemma 2/3
add sliding windows, soft-capping and partial RoPE, read by model/variants.py; Gemma's
layers run in model/gemma.py. gpt-oss is the Llama layer with biases on all four attention
projections, attention sinks, alternating sliding and full layers, and its own experts
(model/moe_config.py); docs/gpt-oss.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import rope, variants
from .moe_config import MoEConfig, moe_from_gguf, moe_from_hf, sparse_layers_in_file
from .refused_fields import refuse_unimplemented

# Architectures this engine runs, keyed by GGUF `general.architecture` / HF `model_type`.
# Mixtral, Qwen3-MoE and OLMoE add experts (model/moe.py); a GGUF calls Mixtral "llama"
# with experts and Qwen3-MoE "qwen3moe". Phi-3/4 and Gemma 2/3: model/variants.py.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen3moe", "olmoe",
                           *variants.ARCHITECTURES)
_QK_NORM = ("qwen3", "qwen3_moe", "qwen3moe", "olmoe", "gemma3")

# Weight-only formats with a native kernel, by GGML type id (gguf.GGMLQuantizationType),
# the id the native op takes.
QTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
# --quantization: none = --dtype; gguf = a GGUF file's own blocks where a kernel reads them;
# fp8 = e4m3 weights with per-channel scales, made when the model is placed (model/fp8.py).
QUANTIZATION_CHOICES = ("none", *QTYPES, "gguf", "fp8")
# How fp32 layers hold weights stored narrower than fp32: a GGUF's blocks, F16/BF16 matrices
# (EngineConfig.gguf_weights; auto resolves to one of the others).
GGUF_WEIGHTS = ("auto", "blocks", "dense")


# Far above any Llama-family model (Llama 3 405B: hidden 16384, 126 layers, 128k context)
# and far below sizes whose allocation would take the machine down.
_SIZE_LIMITS = {
    "vocab_size": 1 << 21, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_layers": 1 << 10,
    "num_heads": 1 << 10, "num_kv_heads": 1 << 10, "head_dim": 1 << 12, "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2, gpt-oss: bias on q/k/v projections
    o_bias: bool = False  # gpt-oss: bias on the attention's output projection
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in every softmax (attention/backend.py)
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    # RoPE scaling, normalised by model/rope.py (which documents the types). A llama3 GGUF
    # carries the same information as a `rope_freqs` tensor of per-dimension divisors instead.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    qk_norm_whole: bool = False  # OLMoE: one RMSNorm over all of q's (and k's) heads, not one per head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the norms
    moe: MoEConfig | None = None  # the experts (model/moe.py); None for a dense model
    # Phi-3/4 and Gemma 2/3 (model/variants.py documents each).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = field(default=None, hash=False)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # A model file's numbers size every allocation that follows: refuse the absurd ones
        # here, with their names, before anything is allocated from them.
        for name, limit in _SIZE_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ValueError(f"{name} must be an integer in [1, {limit}], got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.clip_qkv is not None and (isinstance(self.clip_qkv, bool) or not isinstance(self.clip_qkv, (int, float))
                                          or not math.isfinite(self.clip_qkv) or self.clip_qkv <= 0):
            raise ValueError(f"clip_qkv must be a finite number > 0 or null, got {self.clip_qkv!r}")
        if isinstance(self.moe, dict):  # as to_dict (and the loader's cache) writes it
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None:
            self.moe.check_layers(self.num_layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        variants.check_fields(self)
        rope.check_scaling(self.rope_scaling)

    def layer_window(self, index: int) -> int:
        """Keys layer `index` may see before a query, its own included (0: every key)."""
        return variants.layer_window(self, index)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (all but Phi-3/4's partial RoPE)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_params(self) -> int:
        """Parameters touched per token (the tied embedding counted once, as the head)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        total = self.num_layers * per_layer + self.vocab_size * h
        if self.moe is not None:  # a sparse layer's MLP is its router and top_k experts
            sparse = 3 * h * (self.moe.top_k * self.moe.expert_size - self.intermediate_size) + h * self.moe.num_experts
            total += len(self.moe.sparse_layers) * sparse
        return total

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["moe"] = None if self.moe is None else dataclasses.asdict(self.moe)
        return out

    @classmethod
    def from_gguf(cls, gguf: Any) -> "ModelConfig":
        """A GGUF file's config (`gguf`: model.gguf_file.GGUFFile): its metadata's, with what
        only its tensor table says: the head tied where there is no output.weight, and which
        layers hold experts."""
        names = {t.name for t in gguf.tensors()}
        config = cls.from_gguf_metadata(gguf.metadata)
        return dataclasses.replace(config, tie_word_embeddings="output.weight" not in names,
                                   moe=sparse_layers_in_file(config.moe, names))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "ModelConfig":
        with _malformed("the GGUF's model metadata"):
            return cls._from_gguf_metadata(meta)

    @classmethod
    def _from_gguf_metadata(cls, meta: dict[str, Any]) -> "ModelConfig":
        arch = str(meta["general.architecture"])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        layers = int(get("block_count"))
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 4096)),
            # Tied when the file has no separate output matrix; the loader decides.
            tie_word_embeddings=False,
            attention_bias=arch == "qwen2",
            qk_norm=arch in _QK_NORM,
            qk_norm_whole=arch == "olmoe",
            clip_qkv=get("attention.clamp_kqv"),
            moe=moe_from_gguf(meta, arch, layers),
            **{**rope.gguf_fields(get, arch), **variants.gguf_fields(arch, get)},
        )

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelConfig":
        with _malformed(str(path)):
            return cls._from_hf_config(json.loads(Path(path).read_text()))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], what: str) -> "ModelConfig":
        """A config.json's parsed dict (an idefics3 folder's text_config: model/idefics3.py);
        `what` names it in errors."""
        with _malformed(what):
            return cls._from_hf_config(cfg)

    @classmethod
    def _from_hf_config(cls, cfg: Any) -> "ModelConfig":
        arch = variants.HF_MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type", ""))
        hidden = int(cfg["hidden_size"])
        refuse_unimplemented(arch, cfg)
        rope_params = rope.params(cfg)
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        num_heads = int(cfg["num_attention_heads"])
        fields = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v bias is the architecture's; elsewhere the flag would bias o too.
            attention_bias=arch == "qwen2",
            qk_norm=arch in _QK_NORM,
            qk_norm_whole=arch == "olmoe",
            clip_qkv=cfg.get("clip_qkv"),
            moe=moe_from_hf(cfg, arch, int(cfg["num_hidden_layers"])),
        )
        return cls(**{**fields, **rope.hf_fields(cfg, rope_params, max_positions), **variants.hf_fields(arch, cfg)})


@contextlib.contextmanager
def _malformed(what: str) -> Iterator[None]:
    """A missing key, a wrong type or bad JSON in a model's config as a ValueError naming
    `what` and the key, not a KeyError that would read as a bug in pagedserve."""
    try:
        yield
    except KeyError as e:
        raise ValueError(f"{what}: required key {e} is missing") from None
    except (TypeError, AttributeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"{what}: {e}") from None
