"""LoRA adapters in PEFT's format on pagedserve's fused layers, and their delta over a
batch that mixes adapters.

PEFT saves one pair per targeted projection, `...layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r], and adds `B @ A @ x * scaling` to that projection's
output. pagedserve computes q/k/v as one GEMM and gate/up as another, so the pairs of one
fused layer become one A^T [in, R * n] and one B^T [R * n, out] (n sub-projections,
R = max_lora_rank): column k * n + j of A^T is row k of sub-projection j's A, and row
k * n + j of B^T holds column k of its B (times the scaling) in j's slice of the fused
output, zeros elsewhere (block-diagonal). Rank-major columns put an adapter of rank r in
the first r * n columns, so each adapter multiplies only by its own rank; a projection it
does not target stays zero. The GGUF's q/k permutation is undone at load, so PEFT's HF
layout applies as it is.

`LoRASlots` stacks `max_loras` adapters per fused layer. Per step, `LoRASlots.batch` sorts
the tokens that run an adapter by slot; on the native kernels each fused layer is then one
op (`lora_add_`, kernels/csrc/lora.cpp: up to four rows of a slot share each read of its A
and B, the delta added straight into the base output's rows); on the torch path each fused
layer gathers those rows once, runs two small GEMMs per adapter segment (views of the stacked
weights, no copies) and adds the result with one index_add_. Either way the base layer's
kernel (fp32, oneDNN-packed or GGUF blocks) is untouched, and so are base-model rows.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.validation import is_int
from .config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FUSED_LAYERS = ("qkv", "o", "gate_up", "down")
# PEFT's module name -> (pagedserve's fused layer, index of the sub-projection in it).
PEFT_PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True, slots=True)
class FusedShape:
    in_features: int
    # (offset, size) of each sub-projection's rows in the fused output.
    slices: tuple[tuple[int, int], ...]

    @property
    def out_features(self) -> int:
        offset, size = self.slices[-1]
        return offset + size


def fused_shapes(config: ModelConfig) -> dict[str, FusedShape]:
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv": FusedShape(h, ((0, q), (q, kv), (q + kv, kv))),
        "o": FusedShape(q, ((0, h),)),
        "gate_up": FusedShape(h, ((0, i), (i, i))),
        "down": FusedShape(i, ((0, h),)),
    }


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter read from disk: its pairs by (layer, fused layer, sub-projection), the
    scaling already folded into B."""

    path: str
    rank: int
    pairs: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(name for _, name, _ in self.pairs)


def load_peft_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the model; ValueError naming what is wrong."""
    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"lora_path {str(path)!r} is not a PEFT adapter folder: it needs {CONFIG_FILE} "
                         f"and {WEIGHTS_FILE}")
    try:
        peft = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: not a readable JSON file ({e})") from None
    if not isinstance(peft, dict):
        raise ValueError(f"{config_file}: expected a JSON object")
    rank, alpha = _check_config(peft, config_file, max_rank)
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    tensors = _read_tensors(weights_file)
    shapes = fused_shapes(config)
    found: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in PEFT_PROJECTIONS:
            raise ValueError(f"{weights_file}: tensor {key!r} is not a LoRA pair of a q/k/v/o/gate/up/down "
                             f"projection (embeddings, lm_head, biases and modules_to_save are not supported)")
        layer = int(m.group(1))
        if layer >= config.num_layers:
            raise ValueError(f"{weights_file}: {key!r} names layer {layer}; the model has {config.num_layers}")
        name, sub = PEFT_PROJECTIONS[m.group(2)]
        if name in ("gate_up", "down") and config.moe is not None and layer in config.moe.sparse_layers:
            raise ValueError(f"{weights_file}: {key!r} adapts layer {layer}'s MLP, which is a mixture of experts; "
                             "LoRA adapts attention (q/k/v/o) and dense MLP layers only")
        found.setdefault((layer, name, sub), {})[m.group(3)] = tensor
    if not found:
        raise ValueError(f"{weights_file}: holds no LoRA weights")
    pairs = {}
    for (layer, name, sub), ab in sorted(found.items()):
        where = f"{weights_file}: layer {layer} {name}[{sub}]"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: needs both lora_A and lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        shape = shapes[name]
        out = shape.slices[sub][1]
        if a.shape != (rank, shape.in_features) or b.shape != (out, rank):
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank {rank} "
                             f"on this model (expected ({rank}, {shape.in_features}) and ({out}, {rank}))")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{where}: holds non-finite values")
        pairs[(layer, name, sub)] = (a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(str(path), rank, pairs)


def _check_config(peft: dict, where: Path, max_rank: int) -> tuple[int, float]:
    if peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {peft.get('peft_type')!r} is not LORA")
    rank, alpha = peft.get("r"), peft.get("lora_alpha")
    if not is_int(rank) or rank < 1:
        raise ValueError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"the adapter's rank {rank} is above max_lora_rank ({max_rank}); restart with "
                         f"--max-lora-rank {rank} or more to serve it")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    # Variants whose delta is not B @ A @ x * scaling on every token of a plain projection.
    for flag in ("use_dora", "fan_in_fan_out", "lora_bias", "alora_invocation_tokens", "layer_replication",
                 "use_bdlora", "target_parameters"):
        if peft.get(flag):
            raise ValueError(f"{where}: {flag} adapters are not supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if peft.get(pattern):
            raise ValueError(f"{where}: per-module ranks or alphas ({pattern}) are not supported")
    if peft.get("bias", "none") != "none":
        raise ValueError(f"{where}: LoRA biases (bias={peft.get('bias')!r}) are not supported")
    return rank, float(alpha)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


@dataclass(frozen=True, slots=True)
class _SlotView:
    a_t: torch.Tensor  # [in, rank * n]: a view of the slot's stacked A^T
    b_t: torch.Tensor  # [rank * n, out]


class LoRASlots:
    """`max_loras` adapters' weights, stacked per layer and fused layer:
    A^T [max_loras, in, R * n] and B^T [max_loras, R * n, out], zeros in empty slots."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, native: bool = False):
        """`native`: apply the deltas with the native op (torch.ops.pagedserve.lora_add_)."""
        self.shapes = fused_shapes(config)
        self.max_loras, self.max_rank, self.native = max_loras, max_rank, native
        self.a_t = [{name: torch.zeros(max_loras, s.in_features, max_rank * len(s.slices))
                     for name, s in self.shapes.items()} for _ in range(config.num_layers)]
        self.b_t = [{name: torch.zeros(max_loras, max_rank * len(s.slices), s.out_features)
                     for name, s in self.shapes.items()} for _ in range(config.num_layers)]
        self.targets: list[frozenset[str]] = [frozenset()] * max_loras
        # Per fused layer, the columns of each slot's A^T in use: rank * n where its
        # adapter targets the layer, else 0 (what the native op reads).
        self.widths = {name: torch.zeros(max_loras, dtype=torch.int64) for name in self.shapes}
        # Per slot, per layer: the fused layers' views trimmed to the slot's rank.
        self.views: list[list[dict[str, _SlotView]]] = [[] for _ in range(max_loras)]
        # The slot of each loaded adapter, by the adapter's id (Request.lora_id).
        self.slot_of: dict[int, int] = {}

    def add(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in a free slot under `lora_id`; ValueError when all are taken."""
        if lora_id in self.slot_of:
            raise ValueError(f"LoRA id {lora_id} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise ValueError(f"max_loras ({self.max_loras}) adapters are loaded; unload one first")
        self._set(free[0], adapter)
        self.slot_of[lora_id] = free[0]

    def remove(self, lora_id: int) -> None:
        self._clear(self.slot_of.pop(lora_id))

    def _set(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"the adapter's rank {adapter.rank} is above max_lora_rank ({self.max_rank})")
        self._clear(slot)
        for (layer, name, sub), (a, b) in adapter.pairs.items():
            n = len(self.shapes[name].slices)
            offset, size = self.shapes[name].slices[sub]
            a_t = self.a_t[layer][name][slot].view(-1, self.max_rank, n)
            b_t = self.b_t[layer][name][slot].view(self.max_rank, n, -1)
            a_t[:, : adapter.rank, sub] = a.T
            b_t[: adapter.rank, sub, offset : offset + size] = b.T
        self.targets[slot] = adapter.targets
        for name, shape in self.shapes.items():
            self.widths[name][slot] = adapter.rank * len(shape.slices) if name in adapter.targets else 0
        self.views[slot] = [
            {name: _SlotView(self.a_t[layer][name][slot][:, : adapter.rank * len(s.slices)],
                             self.b_t[layer][name][slot][: adapter.rank * len(s.slices)])
             for name, s in self.shapes.items()}
            for layer in range(len(self.a_t))
        ]

    def _clear(self, slot: int) -> None:
        for layer in range(len(self.a_t)):
            for name in self.shapes:
                self.a_t[layer][name][slot].zero_()
                self.b_t[layer][name][slot].zero_()
        self.targets[slot] = frozenset()
        for widths in self.widths.values():
            widths[slot] = 0
        self.views[slot] = []

    def batch(self, token_slots: np.ndarray) -> LoRABatch | None:
        """The step's delta plan from each token's slot (-1: the base model); None when no
        token runs an adapter (the forward is then the base model's, at no extra cost)."""
        rows = np.flatnonzero(token_slots >= 0)
        if not len(rows):
            return None
        rows = rows[np.argsort(token_slots[rows], kind="stable")]
        slots, counts = np.unique(token_slots[rows], return_counts=True)
        segments = {name: [(i, self.views[s]) for i, s in enumerate(slots.tolist()) if name in self.targets[s]]
                    for name in FUSED_LAYERS}
        native = (torch.from_numpy(token_slots[rows]), self) if self.native else None
        return LoRABatch(torch.from_numpy(rows), counts.tolist(), segments, native)


@dataclass(frozen=True)
class LoRABatch:
    """One step's adapter rows: token rows grouped by slot, the group sizes, and per fused
    layer the groups whose adapter targets it (group index, that slot's views)."""

    rows: torch.Tensor
    sizes: list[int]
    segments: dict[str, list[tuple[int, list[dict[str, _SlotView]]]]]
    # For the native op (None on the torch path): each of `rows`' slot, and the stacks.
    native: tuple[torch.Tensor, LoRASlots] | None = None

    def add(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += B @ A @ x[rows] * scaling for each row's adapter, in place."""
        segments = self.segments[name]
        if not segments:
            return
        if self.native is not None:
            row_slots, slots = self.native
            torch.ops.pagedserve.lora_add_(y, x.contiguous(), self.rows, row_slots, slots.widths[name],
                                           slots.a_t[layer][name], slots.b_t[layer][name])
            return
        xs = x.index_select(0, self.rows).split(self.sizes)
        # Groups whose adapter skips this layer add nothing: their rows must be zeros.
        fill = y.new_empty if len(segments) == len(self.sizes) else y.new_zeros
        delta = fill(len(self.rows), y.shape[1])
        outs = delta.split(self.sizes)
        for i, views in segments:
            view = views[layer][name]
            torch.mm(torch.mm(xs[i], view.a_t), view.b_t, out=outs[i])
        y.index_add_(0, self.rows, delta)
