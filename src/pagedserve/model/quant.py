"""Weight-only quantisation in llama.cpp's block formats, and the linear and embedding
modules that run on a GGUF file's blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS, MXFP4: model/mxfp4.py)
or on 16-bit float weights as stored (F16, BF16: a GGUF's tensors or a safetensors folder's).

A block is 32 consecutive input values of one output row, stored exactly as a GGUF
file stores it (so `gguf.quants` reads our bytes and we read a file's bytes as they
are): Q8_0 = fp16 scale + 32 int8; Q4_0 = fp16 scale + 16 bytes of nibbles (value
d * (q - 8)); Q4_1 = fp16 scale, fp16 min + 16 bytes of nibbles (d * q + m); byte j
of a 4-bit block holds value j low and value j + 16 high. A weight [N, K] is then a
uint8 tensor [N, K / 32 * block bytes]: rows stay rows, so fusing q/k/v or gate/up
(concatenating rows) and undoing llama.cpp's q/k row permutation work on raw blocks.

QuantLinear repacks the blocks once for pagedserve's native ops, which read them in one
of two ways: `activations="int8"` (kernels/csrc/quant_linear.cpp) quantises each row's
activations too and multiplies in integers, llama.cpp's way; `activations="fp32"`
(dequant_linear.cpp) dequantises the weights in registers and multiplies in fp32, which is
the fp32 model the blocks define, exactly, at about the blocks' bytes per weight
(quant_linear.h's PackedLayout). F16 and BF16 weights widen to fp32 exactly, so they have
only the fp32 form: their layers multiply in fp32 whatever the other layers do. There is no
pure-torch forward, since dequantising every call would be slower than the fp32 layer it
replaces: these layers need the native kernels.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from ..kernels import native_unavailable_reason
from .config import QTYPES
from .mxfp4 import MXFP4, dequantize_mxfp4, quantize_mxfp4

BLOCK = 32
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, MXFP4: 17}  # the types quantize_blocks writes
# GGML types the native ops (fp32 and int8 activations alike) read on their own blocks.
NATIVE_TYPES = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, MXFP4})
# 16-bit float weights as stored (GGML F16, BF16), which the fp32 op alone reads: half of
# fp32's bytes, the same numbers.
F16, BF16 = 1, 30
HALF_TYPES = frozenset({F16, BF16})
HALF_DTYPES = {torch.float16: F16, torch.bfloat16: BF16}


def half_blocks(w: torch.Tensor) -> torch.Tensor | None:
    """A float16 / bfloat16 matrix [N, K] as the ops' rows of stored bytes, uint8 [N, 2K] (a
    view, no copy), or None where the op cannot read it: another dtype, or K not a multiple
    of 32 (the tiles' block)."""
    if w.dtype not in HALF_DTYPES or w.dim() != 2 or w.shape[1] % BLOCK:
        return None
    return w.contiguous().view(torch.uint8)


def held_as(qtype: int) -> str:
    """How the start-up log names weights kept in `qtype`: "on Q4_K blocks", "BF16 as stored"."""
    return f"{type_name(qtype)} as stored" if qtype in HALF_TYPES else f"on {type_name(qtype)} blocks"


def arithmetic(qtype: int, quantization: str) -> str:
    """The activations a layer on `qtype` runs with (ACTIVATIONS): fp32 under quantization
    none and for 16-bit float weights (which have no int8 form), int8 otherwise."""
    return "fp32" if quantization == "none" or qtype in HALF_TYPES else "int8"


def type_name(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


def row_values(blocks: torch.Tensor, qtype: int) -> int:
    """Values per row of blocks uint8 [rows, row bytes] of GGML type `qtype`."""
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return blocks.shape[1] // block_bytes * block_values


def _check_shape(w: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"quantised weights need [rows, K] with K a multiple of {BLOCK}, got {tuple(w.shape)}")


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., n] fp32 -> [..., n, 2] the fp16 bytes (little-endian, as GGUF stores them)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero; torch.round ties to even)."""
    r = torch.trunc(x)
    return r + torch.where((x - r).abs() >= 0.5, torch.sign(x), 0.0)


def quantize_blocks(w: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 [N, K] -> GGUF blocks uint8 [N, K / 32 * block bytes], rounding as llama.cpp's
    reference quantisers do (quantize_row_q8_0_ref, q4_0_ref, q4_1_ref, mxfp4_ref)."""
    _check_shape(w)
    if qtype == MXFP4:
        return quantize_mxfp4(w)
    n, k = w.shape
    x = w.float().reshape(n, k // BLOCK, BLOCK)
    if qtype == QTYPES["q8_0"]:
        d = x.abs().amax(-1) / 127
        inv = torch.where(d != 0, 1 / d, 0.0)
        q = _round_half_away(x * inv[..., None]).to(torch.int8)
        blocks = torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=-1)
    elif qtype == QTYPES["q4_0"]:
        # The value of largest magnitude maps to -8 (llama.cpp keeps its sign).
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx).squeeze(-1) / -8
        inv = torch.where(d != 0, 1 / d, 0.0)
        q = torch.clamp(torch.trunc(x * inv[..., None] + 8.5), max=15).to(torch.uint8)
        blocks = torch.cat([_half_bytes(d), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    elif qtype == QTYPES["q4_1"]:
        lo, hi = x.amin(-1), x.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1 / d, 0.0)
        q = torch.clamp(torch.trunc((x - lo[..., None]) * inv[..., None] + 0.5), max=15).to(torch.uint8)
        blocks = torch.cat([_half_bytes(d), _half_bytes(lo), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    else:
        raise ValueError(f"unsupported qtype {qtype}; supported: {QTYPES} and MXFP4 ({MXFP4})")
    return blocks.reshape(n, -1).contiguous()


def dequantize_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks uint8 [N, row bytes] -> fp32 [N, K] (types beyond quantize_blocks' three by
    gguf's own dequantiser)."""
    if qtype in HALF_TYPES:
        return blocks.contiguous().view(torch.float16 if qtype == F16 else torch.bfloat16).float()
    if qtype == MXFP4:
        return dequantize_mxfp4(blocks)
    if qtype not in BLOCK_BYTES:
        values = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(blocks.shape[0], -1)
    bb = BLOCK_BYTES[qtype]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, bb)
    d = b[..., :2].contiguous().view(torch.float16).float()
    if qtype == QTYPES["q8_0"]:
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[..., -16:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        if qtype == QTYPES["q4_0"]:
            w = d * (q - 8)
        else:
            w = d * q + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(n, -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The native op's on-the-fly activation quantisation, in torch (for tests and
    references): per row, per 32 values, q = round-half-even(x * 127 / amax), scale
    amax / 127. Returns (int8 values, fp32 scales [..., K / 32])."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # Tensor / tensor: a Python number over a tensor is computed as reciprocal * number in
    # torch, one rounding more than the op's 127.0f / amax.
    inv = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, 0.0)
    q = torch.round(blocks * inv).to(torch.int8)
    return q.reshape(x.shape), (amax / 127).squeeze(-1)


ACTIVATIONS = ("int8", "fp32")


def pack(blocks: torch.Tensor | list[torch.Tensor], qtype: int) -> tuple[torch.Tensor, int, int]:
    """GGUF blocks (or a list of them stacked as rows) -> (the native ops' packed tiles,
    rows, values per row)."""
    reason = native_unavailable_reason()  # also loads the library
    if reason is not None:
        raise ValueError(f"layers on GGUF blocks need pagedserve's native kernels, which cannot run here: {reason}")
    parts = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    rows, values = sum(b.shape[0] for b in parts), row_values(parts[0], qtype)
    # The op reads each part's rows where they are (memory-mapped file pages, say).
    parts = [b if b.dim() == 2 and b.stride(-1) == 1 else b.contiguous() for b in parts]
    return torch.ops.pagedserve.quant_repack(parts, qtype), rows, values


class QuantLinear(nn.Module):
    """A linear layer on GGUF blocks (NATIVE_TYPES) or 16-bit floats as stored (HALF_TYPES,
    fp32 activations only); `bias` (fp32) optional; `activations` int8 (quantised on the
    fly) or fp32 (the dequantised weights' exact fp32 product)."""

    def __init__(self, blocks: torch.Tensor | list[torch.Tensor] | QuantEmbedding, qtype: int,
                 bias: torch.Tensor | None = None, activations: str = "int8"):
        """`blocks`: uint8 [rows, row bytes], a list of them stacked as rows (a fused matrix's
        parts, packed one by one), or a QuantEmbedding whose tiles a tied head shares."""
        super().__init__()
        if qtype not in NATIVE_TYPES | HALF_TYPES:
            raise ValueError(f"unsupported qtype {qtype}; supported: "
                             + ", ".join(f"{type_name(t)} ({t})" for t in sorted(NATIVE_TYPES | HALF_TYPES)))
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        if activations == "int8" and qtype in HALF_TYPES:
            raise ValueError(f"{type_name(qtype)} weights run with fp32 activations only, got activations='int8'")
        self.activations = activations
        self.qtype = qtype
        # Plain attributes, not parameters or buffers: the model's state dict keeps the
        # checkpoint's names and layout, which these replace (LlamaModel.load_weights).
        self.bias = None if bias is None else bias.float().contiguous()
        if isinstance(blocks, QuantEmbedding):
            self.packed, self.out_features, self.in_features = blocks.packed, blocks.rows, blocks.dim
        else:
            self.packed, self.out_features, self.in_features = pack(blocks, qtype)
        # After pack(), which loads the op library (or says why it cannot).
        self._op = torch.ops.pagedserve.quant_linear if activations == "int8" else torch.ops.pagedserve.dequant_linear

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> "QuantLinear":
        return cls(quantize_blocks(weight, qtype), qtype, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.qtype, self.out_features, self.bias)

    def describe(self) -> str:
        """What the start-up log calls this layer's path, e.g. "on Q4_K blocks (int8 arithmetic)"."""
        return f"{held_as(self.qtype)} ({self.activations} arithmetic)"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {type_name(self.qtype)}, "
                f"{self.activations} activations")


class ConcatLinear(nn.Module):
    """One fused matrix whose row ranges a file stores in different types (Q4_K_M's q and k
    in Q4_K, v in Q6_K): each range on its own blocks, the outputs side by side."""

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """Token embedding kept as the native ops' packed tiles (a tied LM head multiplies with
    the same ones): looked-up rows are read back out of them (quant_unpack_rows), the
    values the file's blocks hold."""

    def __init__(self, blocks: torch.Tensor, qtype: int):
        super().__init__()
        if qtype not in NATIVE_TYPES | HALF_TYPES:
            raise ValueError(f"unsupported qtype {qtype} for an embedding on blocks")
        self.qtype = qtype
        self.packed, self.rows, self.dim = pack(blocks, qtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.pagedserve.quant_unpack_rows(self.packed, self.qtype, ids.reshape(-1))
        return rows.reshape(*ids.shape, self.dim)
