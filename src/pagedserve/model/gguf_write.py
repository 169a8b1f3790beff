"""Write a GGUF file from Hugging Face weights (a folder, or tensors made in memory), the
way llama.cpp's converter lays one out: test and benchmark files of any architecture
pagedserve runs, MoE included, in any type gguf_rewrite.quantize_as writes, without a hub.

Names follow llama.cpp (weights._GGUF_LAYER_NAMES inverted; experts as the 3-D
`blk.N.ffn_{gate,up,down}_exps`), llama-architecture q/k rows are permuted as its converter
permutes them, and the tokenizer is copied from another GGUF (by default the shipped one).

    python -m pagedserve.model.gguf_write HF_FOLDER DST.gguf --type q4_k
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType

from . import rope
from .config import ModelConfig
from .gguf_rewrite import add_tensor_as, copy_metadata, finish
from .moe_weights import stack_hf_experts
from .weights import gguf_name_for_hf, hf_tensors_from_safetensors

# HF model_type -> llama.cpp's architecture name (Mixtral is llama with experts).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3_moe": "qwen3moe", "qwen3moe": "qwen3moe", "olmoe": "olmoe"}
# (GGUF tensor name, shape in PyTorch order) -> the type to store it in.
TypeChooser = Callable[[str, tuple[int, ...]], GGMLQuantizationType]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's q/k row order for llama files (weights.undo_llama_cpp_permute inverts it)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_config(writer: GGUFWriter, config: ModelConfig) -> None:
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.top_k)
        writer.add_expert_feed_forward_length(config.moe.expert_size)
        writer.add_expert_weights_norm(config.moe.normalize_top_k)
    _add_rope_scaling(writer, config)


def _add_rope_scaling(writer: GGUFWriter, config: ModelConfig) -> None:
    """RoPE scaling's metadata as llama.cpp's converter writes it (model/rope.py reads it back);
    llama3's divisors go in the rope_freqs tensor instead (write_gguf)."""
    rs, kind = config.rope_scaling, rope.scaling_type(config.rope_scaling)
    if kind is None or kind == "llama3":
        return
    if kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rs["factor"])
        return
    if kind != "yarn" or rs.get("truncate", True) is not True:
        raise ValueError(f"write_gguf does not write rope_type {kind!r}" + (" with truncate false" if kind == "yarn" else ""))
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rs["factor"])
    writer.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    # The factor whatever derived it (mscale / mscale_all_dim have no GGUF key).
    writer.add_rope_scaling_yarn_attn_factor(rope.attention_factor(config))
    if rs.get("beta_fast"):
        writer.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
    if rs.get("beta_slow"):
        writer.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])


def write_gguf(dst: str | Path, config: ModelConfig, hf: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
               tokenizer_gguf: str | Path, choose: TypeChooser) -> dict[str, str]:
    """Write `hf` (HF names, fp32: a checkpoint's dict, or (name, tensor) pairs made one at a
    time, experts already stacked as moe_weights names them, so that a large random model is
    never whole in memory) as a GGUF of `config`'s architecture, each matrix in the type
    choose(name, shape) gives (1-D tensors stay F32); returns {GGUF name: type}."""
    arch = GGUF_ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise ValueError(f"no GGUF architecture for {config.architecture!r}")
    writer = GGUFWriter(dst, arch)
    copy_metadata(GGUFReader(tokenizer_gguf), writer, keep=lambda key: key.startswith("tokenizer."))
    _add_config(writer, config)
    written = {}
    pairs = stack_hf_experts(hf, config).items() if isinstance(hf, dict) else hf
    if rope.scaling_type(config.rope_scaling) == "llama3":
        pairs = [*pairs, ("rope_freqs", rope.freq_divisors(config))]
    for hf_name, tensor in pairs:
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        name = gguf_name_for_hf(hf_name)
        values = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            values = llama_cpp_permute(values, config.num_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            values = llama_cpp_permute(values, config.num_kv_heads)
        qtype = GGMLQuantizationType.F32 if values.ndim == 1 else choose(name, values.shape)
        add_tensor_as(writer, name, np.ascontiguousarray(values), qtype)
        written[name] = qtype.name
    finish(writer)
    return written


def main(argv: list[str] | None = None) -> int:
    from .registry import default_model_path

    parser = argparse.ArgumentParser(prog="python -m pagedserve.model.gguf_write", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a Hugging Face folder (config.json and *.safetensors)")
    parser.add_argument("dst")
    parser.add_argument("--type", required=True, help="the matrices' type: q4_k, q6_k, q8_0, f16, ...")
    parser.add_argument("--tokenizer-from", default=None, help="a GGUF whose tokenizer to copy (default: the shipped one)")
    args = parser.parse_args(argv)
    folder = Path(args.src)
    config = ModelConfig.from_hf_config(folder / "config.json")
    target = GGMLQuantizationType[args.type.upper()]
    written = write_gguf(args.dst, config, hf_tensors_from_safetensors(folder), args.tokenizer_from or default_model_path(),
                         lambda name, shape: target)
    for name, kind in written.items():
        print(f"{name}: {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
