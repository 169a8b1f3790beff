"""FP8 (e4m3) weights: `--quantization fp8`, made from the loaded weights when the model is
placed on its device (model/device_placement.py).

A weight [N, K] is stored as e4m3 values and one fp32 scale per output channel (row), or one
for the whole tensor: scale = amax / 448 (e4m3's largest finite value), so each row's largest
entry maps to +-448 and the rest keep e4m3's 3-bit mantissa relative to their own size.
Activations are quantised the same way on the fly, per token (row) with per-channel weights,
or per tensor with a per-tensor weight. Then

    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]

which torch._scaled_mm computes with fp32 accumulation: on CUDA devices with FP8 tensor
cores (compute capability 8.9 and up), and, in torch 2.13, on CPU too (a slow reference
kernel: the tests check it against the dequantised product). Elsewhere (an A100) the weight
is dequantised per call and multiplied at the activation dtype (weight-only FP8).

The LM head and the embedding stay at the model's dtype, as FP8 checkpoints keep them, and
as the memory plan (core/memory_plan.weight_bytes) counts them.
"""
from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GRANULARITIES = ("channel", "tensor")
# torch._scaled_mm on CUDA wants both the inner and the output dimension divisible by 16.
_MM_ALIGN = 16


def fp8_scale(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """fp32 scales amax / 448, per row ([R, 1]) or for the tensor ([]); an all-zero row gets 1."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, saturated at +-448 (torch's own cast gives NaN past it)."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs FP8 x FP8 on this device."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


class Fp8Linear(nn.Module):
    """A linear layer over e4m3 weights with per-channel or per-tensor scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, granularity: str = "channel"):
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        self.per_channel = granularity == "channel"
        self.out_features, self.in_features = weight.shape
        scale = fp8_scale(weight, self.per_channel)  # [N, 1] or []
        self.weight = quantize_fp8(weight, scale)
        # _scaled_mm takes the weight's scale as a [1, N] row (or a scalar).
        self.weight_scale = scale.reshape(1, -1) if self.per_channel else scale
        self.bias = bias
        self.use_scaled_mm = (scaled_mm_supported(weight.device) and self.in_features % _MM_ALIGN == 0
                              and self.out_features % _MM_ALIGN == 0)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer computes with, in fp32 [N, K]."""
        scale = self.weight_scale.reshape(-1, 1) if self.per_channel else self.weight_scale
        return self.weight.float() * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_scaled_mm:
            y = x @ self.dequantized_weight().to(x.dtype).t()
        else:
            x_scale = fp8_scale(x, self.per_channel)
            # CUDA's row-wise kernel writes bf16 only; the CPU kernel and per-tensor ones any float.
            out_dtype = torch.bfloat16 if self.per_channel and x.is_cuda else x.dtype
            y = torch._scaled_mm(quantize_fp8(x, x_scale), self.weight.t(), scale_a=x_scale,
                                 scale_b=self.weight_scale, out_dtype=out_dtype).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        mode = "scaled_mm" if self.use_scaled_mm else "dequantised"
        return (f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per "
                f"{'channel' if self.per_channel else 'tensor'}, {mode}")
