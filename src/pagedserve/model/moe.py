"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and OLMoE (model/moe_config.py).

Routing: softmax over the router's logits (in fp32), the top k experts per token, their
probabilities renormalised to sum to 1 where the architecture does (MoEConfig.
normalize_top_k). Each expert is a SwiGLU MLP: down(silu(gate(x)) * up(x)).

Only the experts a step's tokens were sent to are computed. Experts held in fp32 (an HF
folder) run in torch: the step's (token, expert) pairs are sorted by expert, and each expert
that has tokens multiplies its contiguous slice of the gathered rows, one matmul per matrix
(a Python loop over the experts present, at most num_experts a step, never over tokens).
Experts on a GGUF file's blocks run in one native op per layer (kernels/csrc/moe_experts.cpp)
that reads only the selected experts' tiles, in the arithmetic the model's dense layers on
blocks take (quant.arithmetic): fp32, dequant_linear's (`moe_experts`, --quantization none),
or int8 activations, quant_linear's (`moe_experts_int8`, --quantization gguf and the q*_0 /
q4_1 modes), a token's products then the bits quant_linear gives on its row alone. Either
way a token's k results are added in ascending expert id, as transformers adds them.

gpt-oss (MoEConfig's softmax_after_top_k, biases, activation): the router's top k logits
go through a softmax of their own; each expert matrix adds its bias; the activation is the
clamped SwiGLU (clamped_swiglu below). The native experts op fuses SiLU x up and has no
biases, so such experts on blocks run the grouped loop too, each expert's products on its
own tiles through quant_linear / dequant_linear (QuantExperts.expert), in the arithmetic
the fused op would take, with the activation applied between them in torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .moe_config import MoEConfig
from .quant import ACTIVATIONS, NATIVE_TYPES, pack, quantize_blocks, type_name


def route(logits: torch.Tensor, top_k: int, normalize: bool, softmax_after_top_k: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k])."""
    if softmax_after_top_k:  # gpt-oss: its k weights sum to 1 by construction
        top, experts = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: gate capped at limit, up clamped to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert, tokens in order within an expert."""

    rows: torch.Tensor  # [T * k] the token of each pair
    weights: torch.Tensor  # [T * k] its router weight
    counts: list[int]  # pairs per expert [E]: expert e's are the slice after experts 0 .. e - 1's


def group_by_expert(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> ExpertGroups:
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order // experts.shape[1], weights.reshape(-1)[order], counts)


class ExpertStack(nn.Module):
    """Every expert's matrix of one kind (gate, up or down) in fp32: weight [E, out, in] as
    loaded (and with `bias`, bias [E, out]); after pack(), one prepacked layer per expert
    instead (the model's oneDNN Linear: a row's product then does not depend on how many
    rows its expert got this step)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, bias: bool = False):
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, out_features, in_features),
                                                        requires_grad=False)
        self.bias: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, out_features),
                                                      requires_grad=False) if bias else None
        self.experts: nn.ModuleList | None = None

    def pack(self, make_layer: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        if self.weight is not None:
            biases = [None] * len(self.weight) if self.bias is None else list(self.bias.detach())
            self.experts = nn.ModuleList(make_layer(w, b) for w, b in zip(self.weight.detach(), biases))
            self.weight = self.bias = None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            return self.experts[e](x)
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])


class QuantExperts(nn.Module):
    """Every expert's matrix of one kind on GGUF blocks: uint8 [E, out, row bytes] packed
    once per expert into the native ops' tiles, stacked: packed [E, tile groups, super-blocks, bytes].
    `activations` (quant.ACTIVATIONS): int8 (quant_linear's arithmetic) or fp32 (dequant_linear's).
    `bias` [E, out] (fp32), where the architecture has one (gpt-oss)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, activations: str = "int8", bias: torch.Tensor | None = None):
        super().__init__()
        if qtype not in NATIVE_TYPES:
            raise ValueError(f"experts on {type_name(qtype)} blocks have no native kernel")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        first, self.out_features, self.in_features = pack(blocks[0].contiguous(), qtype)
        self.qtype = qtype
        self.activations = activations
        # Plain attribute (as QuantLinear's): the state dict keeps the checkpoint's names.
        self.packed = torch.empty((blocks.shape[0], *first.shape), dtype=torch.uint8)
        self.packed[0] = first
        for e in range(1, blocks.shape[0]):
            self.packed[e] = pack(blocks[e].contiguous(), qtype)[0]
        self.bias = None if bias is None else bias.float().contiguous()

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: int, activations: str = "int8",
                   bias: torch.Tensor | None = None) -> "QuantExperts":
        e, n, k = weight.shape
        return cls(quantize_blocks(weight.reshape(e * n, k), qtype).reshape(e, n, -1), qtype, activations, bias)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's product alone, on its tiles: a QuantLinear's op and arithmetic."""
        op = torch.ops.pagedserve.quant_linear if self.activations == "int8" else torch.ops.pagedserve.dequant_linear
        return op(x, self.packed[e], self.qtype, self.out_features, None if self.bias is None else self.bias[e])

    def extra_repr(self) -> str:
        return f"experts={self.packed.shape[0]}, in_features={self.in_features}, out_features={self.out_features}, " \
               f"{type_name(self.qtype)}, {self.activations} activations"


class MoE(nn.Module):
    """The sparse MLP of one decoder layer. `router` is the [E, hidden] linear layer (the
    model's own Linear class, built by the caller)."""

    def __init__(self, config: MoEConfig, hidden_size: int, router: nn.Module):
        super().__init__()
        self.config = config
        self.router = router
        e, i, bias = config.num_experts, config.expert_size, config.biases
        self.gate: ExpertStack | QuantExperts = ExpertStack(e, i, hidden_size, bias)
        self.up: ExpertStack | QuantExperts = ExpertStack(e, i, hidden_size, bias)
        self.down: ExpertStack | QuantExperts = ExpertStack(e, hidden_size, i, bias)

    def on_blocks(self) -> bool:
        return all(isinstance(m, QuantExperts) for m in (self.gate, self.up, self.down))

    def blocks_arithmetic(self) -> str:
        """The activations the experts' op on blocks runs with: int8 only where gate, up and
        down all ask for it (one op multiplies all three), else fp32."""
        return "int8" if all(m.activations == "int8" for m in (self.gate, self.up, self.down)) else "fp32"

    def fused_op(self) -> bool:
        """Whether the native experts op computes this layer: experts on blocks with the
        op's own activation (SiLU x up) and no biases."""
        return self.on_blocks() and self.config.activation == "silu" and not self.config.biases

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, experts = route(self.router(x), c.top_k, c.normalize_top_k, c.softmax_after_top_k)
        if self.fused_op():
            g, u, d = self.gate, self.up, self.down
            op = torch.ops.pagedserve.moe_experts_int8 if self.blocks_arithmetic() == "int8" \
                else torch.ops.pagedserve.moe_experts
            return op(x, experts, weights, g.packed, g.qtype, u.packed, u.qtype, d.packed, d.qtype,
                      self.config.expert_size)
        return self._grouped(x, group_by_expert(weights, experts, self.config.num_experts))

    def _grouped(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        xs = x.index_select(0, groups.rows)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(groups.counts):
            if n == 0:
                continue
            xe = xs[start:start + n]
            act = self.activate(self.gate.expert(e, xe), self.up.expert(e, xe))
            ys[start:start + n] = self.down.expert(e, act)
            start += n
        ys.mul_(groups.weights.to(ys.dtype)[:, None])
        # Pairs in expert order: each token's k results are added in ascending expert id.
        return torch.zeros_like(x).index_add_(0, groups.rows, ys)

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.config.activation == "clamped_swiglu":
            return clamped_swiglu(gate, up, self.config.swiglu_alpha, self.config.swiglu_limit)
        return F.silu(gate) * up

    def pack(self, make_layer: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        """Each fp32 expert matrix as make_layer(weight [out, in], bias [out] or None) (the
        model's packed Linear)."""
        for stack in (self.gate, self.up, self.down):
            if isinstance(stack, ExpertStack):
                stack.pack(make_layer)

    def quantize(self, qtype: int, activations: str = "int8") -> None:
        """The fp32 experts as `qtype` blocks (--quantization q8_0 / q4_0 / q4_1), run with
        `activations` as the dense layers quantised beside them."""
        for name in ("gate", "up", "down"):
            stack = getattr(self, name)
            if isinstance(stack, ExpertStack):
                setattr(self, name, QuantExperts.from_float(stack.weight, qtype, activations, stack.bias))

    def weight_paths(self) -> list[str]:
        """What each expert matrix runs on, for the start-up log."""
        def path(m: ExpertStack | QuantExperts) -> str:
            if isinstance(m, QuantExperts):
                arithmetic = self.blocks_arithmetic() if self.fused_op() else m.activations
                return f"expert stack on {type_name(m.qtype)} blocks ({arithmetic} arithmetic)"
            return "expert stack fp32 (oneDNN packed)" if m.weight is None else f"expert stack {m.weight.dtype} (torch)"
        return [path(m) for m in (self.gate, self.up, self.down)]
