"""MXFP4 (OCP microscaling FP4; GGML type 39): gpt-oss's expert weights.

A block is 32 consecutive input values of one output row in 17 bytes, as a GGUF file stores
it: one E8M0 scale byte e (the power of two 2^(e - 127)), then 16 bytes of 4-bit E2M1 codes
(sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives),
byte j holding value j in its low nibble and value j + 16 in its high one. A value is
2^(e - 127) * E2M1[code] = 2^(e - 128) * BOOK[code] with BOOK the codes doubled, small
integers (ggml's kvalues_mxfp4): the native kernels multiply by those, so the weights they
use are the real values exactly.

Hugging Face's gpt-oss checkpoints hold the same bits in another layout: `*_blocks` uint8
[..., out, K / 32, 16] with byte i holding value 2i low and 2i + 1 high, and `*_scales`
uint8 [..., out, K / 32]. `blocks_from_hf` moves the nibbles, never rounding.
"""
from __future__ import annotations

import torch

MXFP4 = 39  # GGMLQuantizationType.MXFP4
BLOCK, BLOCK_BYTES = 32, 17
# E2M1 codes doubled (ggml-common.h kvalues_mxfp4); code 8 is -0, which the doubling makes 0.
BOOK = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)
# E2M1's largest magnitude is 6 = 1.5 * 2^2: OCP's shared exponent is floor(log2(amax)) - 2.
_EMAX_ELEM = 2


def half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(e - 128), BOOK's scale, built from its bits as ggml's
    ggml_e8m0_to_fp32_half builds it (a subnormal for e < 2; exact for every byte)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., K / 32 * 17] -> fp32 [..., K]."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"MXFP4 blocks must be uint8 rows of whole {BLOCK_BYTES}-byte blocks, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    b = blocks.reshape(*blocks.shape[:-1], -1, BLOCK_BYTES)
    qs = b[..., 1:].long()
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    values = BOOK[codes] * half_scale(b[..., 0])[..., None]
    return values.reshape(*blocks.shape[:-1], -1)


def quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] (K a multiple of 32) -> MXFP4 blocks uint8 [..., K / 32 * 17], as ggml's
    quantize_row_mxfp4_ref: the shared exponent e = floor(log2(amax)) - 2 + 127 (0 for an
    all-zero block, and held at 0 where amax < 2^-125 would take it below, where ggml's byte
    wraps; values past 6 * 2^(e - 127) clamp to +-6), each value the nearest code, a tie
    going to the first in BOOK's order (the smaller magnitude)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 weights need rows of whole {BLOCK}-value blocks, got {tuple(w.shape)}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1)
    # frexp's exponent is floor(log2(amax)) + 1, exactly (log2 in floats can round up to it).
    floor_log2 = torch.frexp(amax).exponent - 1
    e = torch.where(amax > 0, floor_log2 - _EMAX_ELEM + 127, 0).clamp(0, 254).to(torch.uint8)
    values = half_scale(e)[..., None, None] * BOOK  # [..., blocks, 1, 16]: each block's 16 values
    codes = (values - x[..., None]).abs().argmin(-1).to(torch.uint8)
    out = torch.cat([e[..., None], codes[..., :16] | (codes[..., 16:] << 4)], dim=-1)
    return out.reshape(*w.shape[:-1], -1)


def blocks_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A gpt-oss checkpoint's `*_blocks` uint8 [..., out, K / 32, 16] and `*_scales` uint8
    [..., out, K / 32] -> MXFP4 blocks uint8 [..., out, K / 32 * 17] (GGUF's layout, which
    QuantLinear and QuantExperts take), the same bits."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., K / 32, 16] need scales [..., K / 32], got {tuple(blocks.shape)} "
                         f"and {tuple(scales.shape)}")
    # HF byte i: values 2i (low) and 2i + 1 (high); GGUF byte j: values j (low) and j + 16 (high).
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat([scales[..., None], packed], dim=-1)
    return out.reshape(*scales.shape[:-1], -1)
