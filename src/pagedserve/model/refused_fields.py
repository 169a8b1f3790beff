"""config.json fields the config loader does not turn into ModelConfig fields: those that
never change a model's arithmetic (INERT, each with why), and those pagedserve implements at
one value only, refused by name at any other (a field ignored would be a silently wrong
model). tests/test_hf_config_fields.py walks transformers' config class of each
architecture so that a field it adds is one of these or read."""
from __future__ import annotations

from typing import Any

from .rope import params

INERT: dict[str, str] = {
    "_name_or_path": "where the checkpoint was loaded from",
    "architectures": "transformers' class names; model_type picks the architecture",
    "transformers_version": "the version that wrote the file",
    "dtype": "the stored dtype; pagedserve computes in its own --dtype",
    "torch_dtype": "the stored dtype (older name); pagedserve computes in its own --dtype",
    "use_cache": "transformers' KV-cache switch; pagedserve always pages its cache",
    "output_attentions": "what transformers returns beside the logits",
    "output_hidden_states": "what transformers returns beside the logits",
    "return_dict": "the shape of transformers' return value",
    "output_router_logits": "router logits returned for a training loss",
    "router_aux_loss_coef": "a training loss's weight",
    "router_jitter_noise": "noise on the router's input in training only",
    "attention_dropout": "dropout, off at inference",
    "embd_pdrop": "dropout, off at inference",
    "resid_pdrop": "dropout, off at inference",
    "initializer_range": "the spread of freshly initialised weights",
    "bos_token_id": "a token id for the tokenizer and generation, not the arithmetic",
    "eos_token_id": "a token id for the tokenizer and generation, not the arithmetic",
    "pad_token_id": "a token id (the embedding's padding row only matters to gradients)",
    "id2label": "a classification head's labels",
    "label2id": "a classification head's labels",
    "problem_type": "a classification head's loss",
    "is_encoder_decoder": "False for every decoder-only model_type pagedserve loads",
    "chunk_size_feed_forward": "transformers' chunking of the MLP over tokens: the same values",
    "pretraining_tp": "the tensor-parallel degree of training; transformers 5 computes without it",
    "original_max_position_embeddings": "read only with a RoPE scaling that uses it (model/rope.py)",
    "_sliding_window_pattern": "Gemma 3's pattern, read only where layer_types is absent",
}

# Field -> the values at which pagedserve's arithmetic is transformers' (None: absent).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "mlp_bias": (None, False),  # a bias on the MLP's matrices
    "attention_bias": (None, False),  # a bias on q, k, v and o (Qwen2's q/k/v bias is the architecture's)
    "hidden_act": (None, "silu"),
    "partial_rotary_factor": (None, 1, 1.0),  # RoPE over part of a head (Phi-3/4's is read)
    "use_bidirectional_attention": (None, False),
}
# Architectures that read a NEUTRAL field themselves (model/variants.py), or, Qwen2's
# attention_bias, whose q/k/v bias transformers applies whatever the field says.
READ_BY = {"attention_bias": ("qwen2", "gpt_oss"), "partial_rotary_factor": ("phi3",), "hidden_act": ("gemma2", "gemma3")}


def refuse_unimplemented(arch: str, cfg: dict[str, Any]) -> None:
    """ValueError naming the first NEUTRAL field of config.json `cfg` (or of its flat
    RoPE dict) that holds a value pagedserve does not implement for `arch`."""
    rope = params(cfg)
    for name, neutral in NEUTRAL.items():
        if arch in READ_BY.get(name, ()):
            continue
        value = rope.get(name, cfg.get(name))
        if value not in neutral:
            raise ValueError(f"{name}={value!r} is not implemented for {arch} (implemented: {neutral[1:]})")
