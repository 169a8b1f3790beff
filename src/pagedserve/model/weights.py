"""Turn a checkpoint (GGUF or HF safetensors) into pagedserve's fused state dict: float32,
or with the matrices a native kernel reads kept as stored (GGUF blocks, F16 / BF16).

Both sources are first mapped to Hugging Face parameter names and layout, then
fused the way the model computes: q/k/v as one matrix, gate/up as one matrix, so a
layer is three GEMMs (plus the output projection) instead of six.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import rope, variants
from .config import ModelConfig
from .gguf_file import GGUFTensor
from .moe_weights import GGUF_EXPERT_NAMES, expert_biases, expert_matrices, keep_experts_whole, stack_hf_experts
from .quant import HALF_DTYPES, HALF_TYPES, NATIVE_TYPES, dequantize_blocks, half_blocks

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **GGUF_EXPERT_NAMES,
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name_for_gguf(name: str, arch: str) -> str | None:
    global_names = {**_GGUF_GLOBAL_NAMES, **variants.GGUF_GLOBAL_NAMES.get(arch, {})}
    if name in global_names:
        return global_names[name]
    layer_names = {**_GGUF_LAYER_NAMES, **variants.GGUF_LAYER_NAMES.get(arch, {})}
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    return None


def gguf_name_for_hf(name: str) -> str:
    """The llama.cpp tensor name of an HF-named tensor (_hf_name_for_gguf inverted)."""
    globals_ = {hf: g for g, hf in _GGUF_GLOBAL_NAMES.items()}
    if name in globals_:
        return globals_[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    layer = {hf: g for g, hf in _GGUF_LAYER_NAMES.items()}
    if m is None or m.group(2) not in layer:
        raise ValueError(f"no GGUF name for tensor {name!r}")
    return f"blk.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def undo_llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows so that RoPE rotates
    interleaved pairs (x0,x1),(x2,x3)...; HF rotates halves (x0,x32),(x1,x33)...
    Invert that row permutation so one RoPE serves GGUF and HF checkpoints."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (
        w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows, *w.shape[1:])
    )


def hf_tensors_from_gguf(
    tensors: list[GGUFTensor], config: ModelConfig, keep_blocks: Collection[int] = (),
    select: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """fp32 tensors under HF names; matrices whose GGML type is in `keep_blocks` stay in
    their blocks, uint8 [rows, row bytes] (model/quant.py): rows are whole blocks, so the q/k
    row permutation below applies to them as to floats. `select(name, tensor)` keeps part of each tensor as soon
    as it is read (a tensor-parallel rank's shard)."""
    out: dict[str, torch.Tensor] = {}
    # Only llama-arch files are permuted by the converter (Qwen2/3 use HF's rotation already).
    permuted = config.architecture in ("llama", "mistral")
    for t in tensors:
        name = _hf_name_for_gguf(t.name, config.architecture)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in a {config.architecture} model")
        # Matrices, and an MoE layer's expert stacks [experts, rows, K] (on blocks only: 16-bit
        # experts are widened, as the experts op has no half tiles).
        if t.qtype in keep_blocks and (len(t.shape) == 2 or (len(t.shape) == 3 and t.qtype not in HALF_TYPES)) \
                and (t.qtype not in HALF_TYPES or t.shape[-1] % 32 == 0):
            # Views of the file's memory map (F16's as bytes): the model's packing copies them once.
            w = np.asarray(t.raw).view(np.uint8).reshape(*t.shape[:-1], -1)
        else:
            w = t.to_float32()
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = undo_llama_cpp_permute(w, config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = undo_llama_cpp_permute(w, config.num_kv_heads)
        elif variants.gguf_norm_offset(config.architecture, name):
            w = w - np.float32(1.0)
        out[name] = _tensor(w) if select is None else select(name, _tensor(w))
    return out


def _tensor(w: np.ndarray) -> torch.Tensor:
    """torch's view of an array, read-only memory maps included (torch warns about those,
    but nothing here writes to a weight)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(w)


def hf_tensors_from_safetensors(folder: Path, as_stored: bool = False) -> dict[str, torch.Tensor]:
    """The folder's tensors in float32, or `as_stored` in the dtypes the files hold."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v if as_stored else v.float() for k, v in load_file(f).items()})
    return out


def fused_matrices(config: ModelConfig, hf_names: Collection[str]) -> dict[str, list[str]]:
    """Each weight matrix of pagedserve's LlamaModel -> the HF matrices whose rows it
    concatenates (q/k/v into qkv, gate/up into gate_up; Phi-3/4 store both fused already)."""
    out = {"embed.weight": ["model.embed_tokens.weight"]}
    if "lm_head.weight" in hf_names and not config.tie_word_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]
    sparse = set(config.moe.sparse_layers) if config.moe is not None else set()
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        fused_qkv, fused_gate_up = a + "qkv_proj.weight", m + "gate_up_proj.weight"
        out[f"layers.{i}.qkv.weight"] = [fused_qkv] if fused_qkv in hf_names else [a + f"{x}_proj.weight" for x in "qkv"]
        out[f"layers.{i}.o.weight"] = [a + "o_proj.weight"]
        if i in sparse:
            out.update(expert_matrices(i))
            continue
        out[f"layers.{i}.gate_up.weight"] = [fused_gate_up] if fused_gate_up in hf_names else [
            m + "gate_proj.weight", m + "up_proj.weight"]
        out[f"layers.{i}.down.weight"] = [m + "down_proj.weight"]
    return out


def fuse_hf_tensors(hf: dict[str, torch.Tensor], config: ModelConfig, apart: Collection[str] = ()
                    ) -> dict[str, Any]:
    """HF names -> the fused parameter names of pagedserve's LlamaModel. A fused matrix named
    in `apart` stays a list of its parts (GGUF blocks: see fuse_gguf_blocks)."""
    hf = stack_hf_experts(hf, config)
    sd: dict[str, Any] = {
        fused: [hf[p] for p in parts] if fused in apart else _cat([hf[p] for p in parts])
        for fused, parts in fused_matrices(config, hf).items()
    }
    sd["norm.weight"] = hf["model.norm.weight"]
    divisors = hf.get("rope_freqs")  # a llama3 GGUF's, a Phi-3 GGUF's short factors
    if divisors is None:
        divisors = rope.freq_divisors(config)
    if divisors is not None:
        sd["rope_freq_divisors"] = divisors
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        sd[f"layers.{i}.attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        sd[f"layers.{i}.ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            sd[f"layers.{i}.qkv.bias"] = torch.cat([hf[a + f"{x}_proj.bias"] for x in "qkv"])
        if config.o_bias:
            sd[f"layers.{i}.o.bias"] = hf[a + "o_proj.bias"]
        if config.attention_sinks:
            sd[f"layers.{i}.sinks"] = hf[a + "sinks"]
        if config.qk_norm:
            sd[f"layers.{i}.q_norm.weight"] = hf[a + "q_norm.weight"]
            sd[f"layers.{i}.k_norm.weight"] = hf[a + "k_norm.weight"]
    sd.update(expert_biases(hf, config))
    variants.gemma_norms(sd, hf, config)
    return {k: [t.contiguous() for t in v] if isinstance(v, list) else v.contiguous() for k, v in sd.items()}


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def fuse_gguf_blocks(tensors: list[GGUFTensor], config: ModelConfig
                     ) -> tuple[dict[str, Any], dict[str, int | tuple[int, ...]]]:
    """The fused state dict with every matrix that a native kernel reads kept in its GGUF
    blocks (memory-mapped views of the file; F16 / BF16 ones as their bytes), and those
    matrices' GGML types. A fused matrix of several parts (q, k, v) is a list of them with a tuple of their types,
    not concatenated here: the layer packs them one at a time (no second copy of the model
    at load), and Q4_K_M stores v in Q6_K beside q and k in Q4_K. One with a part that has
    no kernel (an F32 matrix, say) is fp32."""
    types = {_hf_name_for_gguf(t.name, config.architecture): int(t.qtype) for t in tensors}
    hf = hf_tensors_from_gguf(tensors, config, keep_blocks=NATIVE_TYPES | HALF_TYPES)
    keep_experts_whole(hf, types, config)
    return _fuse_kept(hf, types, config)


def fuse_stored_halves(hf: dict[str, torch.Tensor], config: ModelConfig
                       ) -> tuple[dict[str, Any], dict[str, int | tuple[int, ...]]]:
    """fuse_gguf_blocks for a safetensors folder read as stored: its float16 / bfloat16
    matrices kept as their bytes (quant.half_blocks: F16 / BF16 for the fp32 op, no float32
    copy), everything else (norms, biases, fp32 or unaligned matrices, MoE expert stacks:
    the experts op has no half tiles) in float32."""
    hf = stack_hf_experts(hf, config)  # the names fused_matrices gives a sparse layer
    matrices = {p for parts in fused_matrices(config, hf).values() for p in parts}
    kept, types = {}, {}
    for name, t in hf.items():
        blocks = half_blocks(t) if name in matrices else None
        if blocks is not None:
            types[name] = HALF_DTYPES[t.dtype]
        kept[name] = t.float() if blocks is None else blocks
    return _fuse_kept(kept, types, config)


def _fuse_kept(hf: dict[str, torch.Tensor], types: dict[str, int], config: ModelConfig
               ) -> tuple[dict[str, Any], dict[str, int | tuple[int, ...]]]:
    """Fuse `hf`, whose uint8 tensors are kept blocks of GGML type types[name]: a fused
    matrix whose parts are all kept stays a list of them (with a tuple of types); the kept
    parts of any other are dequantised to fp32."""
    qtypes: dict[str, int | tuple[int, ...]] = {}
    for fused, parts in fused_matrices(config, hf).items():
        if all(hf[p].dtype == torch.uint8 for p in parts):
            qtypes[fused] = types[parts[0]] if len(parts) == 1 else tuple(types[p] for p in parts)
            continue
        for p in parts:
            if hf[p].dtype == torch.uint8:
                hf[p] = dequantize_blocks(hf[p], types[p])
    return fuse_hf_tensors(hf, config, apart={n for n, t in qtypes.items() if isinstance(t, tuple)}), qtypes
