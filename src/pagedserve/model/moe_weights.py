"""Expert weights under one set of names, whichever checkpoint they come from.

A sparse layer's MLP is four matrices in pagedserve: `moe.router` [E, hidden] and the
stacks `moe.gate`, `moe.up` [E, expert size, hidden] and `moe.down` [E, hidden, expert
size]. A GGUF stores them so already (llama.cpp's `ffn_gate_inp` and 3-D `ffn_{gate,up,
down}_exps`, the same for llama (Mixtral), qwen3moe and olmoe); a Hugging Face checkpoint
stores one matrix per expert (Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`, Qwen3-MoE's
and OLMoE's `mlp.experts.N.gate_proj/up_proj/down_proj`), or transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj` stacks, which are stacked here.

gpt-oss stores its stacks transposed, [E, hidden, 2 x expert size] with gate and up
interleaved (gate the even columns, up the odd ones) and down [E, expert size, hidden],
each with a bias (`gate_up_proj_bias`, `down_proj_bias`), and its router as `mlp.router`
with a bias: they become the same four stacks, each with a `.bias`.
"""
from __future__ import annotations

import re

import torch

from .config import ModelConfig
from .quant import dequantize_blocks

# llama.cpp's tensor names -> the HF-style names this module gives the stacks.
GGUF_EXPERT_NAMES = {"ffn_gate_inp": "moe.router", "ffn_gate_exps": "moe.gate", "ffn_up_exps": "moe.up",
                     "ffn_down_exps": "moe.down"}
MATRICES = ("router", "gate", "up", "down")

_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_KIND = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)")
_GPT_OSS_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)")
_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def stack_hf_experts(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`hf` with every sparse layer's experts as the four `model.layers.N.moe.*.weight` tensors."""
    if config.moe is None:
        return hf
    if config.architecture == "gpt_oss":
        return _stack_gpt_oss(hf)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if m := _PER_EXPERT.fullmatch(name):
            if m.group(3) not in _KIND:
                raise ValueError(f"unexpected expert tensor {name!r}")
            experts.setdefault((int(m.group(1)), _KIND[m.group(3)]), {})[int(m.group(2))] = tensor
        elif m := _ROUTER.fullmatch(name):
            out[_name(int(m.group(1)), "router")] = tensor
        elif m := _FUSED.fullmatch(name):
            layer = int(m.group(1))
            if m.group(2) == "down_proj":
                out[_name(layer, "down")] = tensor
            else:
                out[_name(layer, "gate")], out[_name(layer, "up")] = tensor.chunk(2, dim=1)
        else:
            out[name] = tensor
    n = config.moe.num_experts
    for (layer, kind), by_index in experts.items():
        if sorted(by_index) != list(range(n)):
            raise ValueError(f"layer {layer} has {kind} matrices for experts {sorted(by_index)}; the config says {n}")
        out[_name(layer, kind)] = torch.stack([by_index[i] for i in range(n)])
    return out


def _stack_gpt_oss(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if m := _GPT_OSS_ROUTER.fullmatch(name):
            out[_name(int(m.group(1)), "router", m.group(2))] = tensor
        elif m := _GPT_OSS_EXPERTS.fullmatch(name):
            layer, kind = int(m.group(1)), "bias" if m.group(3) else "weight"
            # Weights [E, in, out] -> [E, out, in]; biases [E, out] as they are.
            t = tensor if m.group(3) else tensor.transpose(1, 2)
            if m.group(2) == "down_proj":
                out[_name(layer, "down", kind)] = t
            else:
                out[_name(layer, "gate", kind)], out[_name(layer, "up", kind)] = t[:, 0::2], t[:, 1::2]
        else:
            out[name] = tensor
    return out


def _name(layer: int, kind: str, part: str = "weight") -> str:
    return f"model.layers.{layer}.moe.{kind}.{part}"


def expert_matrices(layer: int) -> dict[str, list[str]]:
    """A sparse layer's fused state names -> the stacked names they come from (one each)."""
    return {f"layers.{layer}.moe.{kind}.weight": [_name(layer, kind)] for kind in MATRICES}


def expert_biases(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The fused state's router and expert biases (gpt-oss), from the stacked names."""
    if config.moe is None or not config.moe.biases:
        return {}
    return {f"layers.{layer}.moe.{kind}.bias": hf[_name(layer, kind, "bias")]
            for layer in config.moe.sparse_layers for kind in MATRICES}


def keep_experts_whole(hf: dict[str, torch.Tensor], qtypes: dict[str, int], config: ModelConfig) -> None:
    """The native experts op takes gate, up and down all on blocks: where one of a layer's
    three has no kernel (F16, say), all three are dequantised to fp32 (the torch path)."""
    for layer in config.moe.sparse_layers if config.moe is not None else ():
        names = [_name(layer, kind) for kind in ("gate", "up", "down")]
        if all(hf[n].dtype == torch.uint8 for n in names) or not any(hf[n].dtype == torch.uint8 for n in names):
            continue
        for n in names:
            if hf[n].dtype == torch.uint8:
                e, rows = hf[n].shape[:2]
                hf[n] = dequantize_blocks(hf[n].reshape(e * rows, -1), qtypes[n]).reshape(e, rows, -1)
