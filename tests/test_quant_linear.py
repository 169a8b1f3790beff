"""The native quantised linear op (kernels/csrc/quant_linear.cpp) and the block formats
(model/quant.py) against references.

Blocks: our quantiser's bytes must equal gguf's own (`gguf.quants.quantize`) and our
dequantiser must read them exactly as gguf does, so the op runs on a GGUF file's bytes
as they are.

The op: same arithmetic as the reference, so a tight bound. The reference quantises the
activations exactly as the op does (model.quant.quantize_activations, the same fp32
operations, so the int8 values and scales are identical), dequantises both sides and
multiplies in float64. What is left is the op's fp32 arithmetic: per output, each of the
K/32 block terms is an exact int32 dot converted exactly to fp32, times (weight scale x
activation scale) and accumulated with an FMA, plus the min term for Q4 and the bias: at
most ~(K/32 + 4) roundings of 2^-24 relative to the sum of |terms| (the bound below).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernel_paths import outputs_on_every_path
from pagedserve.kernels import resolve_kernels
from pagedserve.model.quant import (
    BLOCK,
    QTYPES,
    QuantLinear,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)

# Loads the op library; a broken build fails these tests rather than skipping them.
resolve_kernels("native")


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # per-row spread of scales
    w[0, :BLOCK] = 0  # an all-zero block: scale 0
    w[-1, 3] = 25.0  # an outlier owns its block's scale
    return w


@pytest.mark.parametrize("name", list(QTYPES))
def test_blocks_bit_exact_with_gguf(name: str) -> None:
    qtype = QTYPES[name]
    w = weights(37, 96)
    blocks = quantize_blocks(w, qtype)
    assert blocks.dtype == torch.uint8 and blocks.shape == (37, 96 // BLOCK * {2: 18, 3: 20, 8: 34}[qtype])
    theirs = quants.quantize(w.numpy(), GGMLQuantizationType(qtype))
    np.testing.assert_array_equal(blocks.numpy(), theirs)
    np.testing.assert_array_equal(
        dequantize_blocks(blocks, qtype).numpy(),
        quants.dequantize(blocks.numpy(), GGMLQuantizationType(qtype)).reshape(37, 96),
    )
    # Round trip: within half a quantisation step of each block (Q4_0: a whole step, as
    # +8 steps clamp to +7), plus the fp16 rounding of the scale (2^-11 of the largest value).
    wb = w.reshape(37, -1, BLOCK)
    err = (dequantize_blocks(blocks, qtype) - w).abs().reshape(37, -1, BLOCK).amax(-1)
    amax = wb.abs().amax(-1)
    bound = {"q8_0": amax / 127 / 2, "q4_0": amax / 8, "q4_1": (wb.amax(-1) - wb.amin(-1)) / 15 / 2}[name]
    assert (err <= bound + amax * 2.0**-10 + 1e-7).all()


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None):
    """(float64 result of the op's arithmetic, the bound on the op's rounding)."""
    q, s = quantize_activations(x)
    xd = (q.double().reshape(*s.shape, BLOCK) * s.double()[..., None]).reshape(x.shape)
    ref = xd @ dequantize_blocks(blocks, qtype).double().T
    if qtype == QTYPES["q8_0"]:
        magnitude = xd.abs() @ dequantize_blocks(blocks, qtype).double().abs().T
    else:
        # The op sums d * q * x and m * x (Q4_0: m = -8d) as separate terms; either can
        # be larger than |w x|, so bound by both.
        b = blocks.reshape(blocks.shape[0], -1, {2: 18, 3: 20}[qtype])
        d = b[..., :2].contiguous().view(torch.float16).double()
        m = 8 * d if qtype == QTYPES["q4_0"] else b[..., 2:4].contiguous().view(torch.float16).double()
        qs = b[..., -16:]
        dq = (torch.cat([qs & 15, qs >> 4], dim=-1).double() * d.abs()).reshape(blocks.shape[0], -1)
        magnitude = xd.abs() @ dq.T + xd.abs().reshape(*s.shape, BLOCK).sum(-1) @ m.abs().squeeze(-1).T
    if bias is not None:
        ref, magnitude = ref + bias.double(), magnitude + bias.double().abs()
    nb = x.shape[-1] // BLOCK
    return ref, (nb + 4) * 2.0**-24 * magnitude + 1e-30


@pytest.mark.parametrize("name", list(QTYPES))
@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (13, 1536), (8, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_op_matches_dequantised_reference(name: str, n: int, k: int, with_bias: bool) -> None:
    qtype = QTYPES[name]
    blocks = quantize_blocks(weights(n, k, seed=n + k), qtype)
    bias = torch.randn(n) if with_bias else None
    layer = QuantLinear(blocks, qtype, bias)
    assert (layer.in_features, layer.out_features) == (k, n)
    x_all = torch.randn(300, k) * torch.rand(300, 1) * 3
    x_all[1, 5] = 40.0  # an activation outlier
    x_all[2] = 0  # an all-zero row
    for rows in (1, 2, 3, 4, 5, 7, 8, 31, 64, 300):
        x = x_all[:rows]
        y = layer(x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        ref, bound = reference(x, blocks, qtype, bias)
        excess = ((y.double() - ref).abs() - bound).max().item()
        assert excess <= 0, f"{name} {n}x{k} rows {rows}: error exceeds the bound by {excess:.3g}"


def test_op_is_row_independent_and_keeps_leading_dims() -> None:
    """A row's result does not depend on the batch around it (row tiles of 4 and the
    tail tiles compute each row alike), and [..., K] inputs keep their leading dims."""
    layer = QuantLinear.from_float(weights(96, 128), QTYPES["q4_1"])
    x = torch.randn(2, 9, 128)
    batched = layer(x)
    assert batched.shape == (2, 9, 96)
    alone = torch.stack([torch.stack([layer(x[i, j : j + 1])[0] for j in range(9)]) for i in range(2)])
    assert torch.equal(batched, alone)
    assert layer(torch.empty(0, 128)).shape == (0, 96)


@pytest.mark.parametrize("name", list(QTYPES))
def test_a_rows_bits_do_not_depend_on_batch_threads_or_instruction_set(name) -> None:
    """VNNI (four whole tiles at a time, 6-row tiles) and AVX2 (one tile, 4-row tiles) sum
    the same exact integer dots and scale them with the same fp32 steps: the same bits for
    every row, whatever batch, thread count or path computes it. The shape has three whole
    4-tile groups, then a partial group whose last tile is partial (the AVX2 path's part)."""
    qtype = QTYPES[name]
    n, k = 8 * 4 * 3 + 13, 320
    layer = QuantLinear(quantize_blocks(weights(n, k, seed=11), qtype), qtype, torch.randn(n))
    x = torch.randn(300, k) * torch.rand(300, 1) * 3
    results = outputs_on_every_path(layer, x, (300, 64, 17, 7, 6, 5, 4, 3, 1))
    for y in results:
        assert torch.equal(y, results[0][: y.shape[0]])


def test_op_rejects_mismatched_arguments() -> None:
    layer = QuantLinear.from_float(weights(16, 64), QTYPES["q8_0"])
    with pytest.raises(RuntimeError, match="input features"):
        layer(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.pagedserve.quant_linear(torch.randn(1, 64), layer.packed, QTYPES["q4_1"], 16, None)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.pagedserve.quant_linear(torch.randn(1, 64), layer.packed, QTYPES["q8_0"], 40, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_blocks(torch.randn(4, 40), QTYPES["q8_0"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QTYPES))
def test_op_sweep_shapes(name: str) -> None:
    qtype = QTYPES[name]
    for n in (1, 7, 9, 63, 65, 200):
        for k in (32, 96, 320, 2048):
            blocks = quantize_blocks(weights(n, k, seed=n * k), qtype)
            layer = QuantLinear(blocks, qtype, torch.randn(n))
            for rows in (1, 3, 4, 6, 17, 129):
                x = torch.randn(rows, k)
                ref, bound = reference(x, blocks, qtype, layer.bias)
                assert ((layer(x).double() - ref).abs() <= bound).all(), (n, k, rows)


# The types only files hold (Q5_0, Q5_1, K-quants), written by gguf's and pagedserve's
# quantisers (test_gguf_types checks the writers), through the same int8 op.
FILE_TYPES = {"q5_0": (22, slice(2, 22)), "q5_1": (24, slice(4, 24)), "q2_k": (84, slice(16, 80)),
              "q3_k": (110, slice(0, 96)), "q4_k": (144, slice(16, 144)), "q5_k": (176, slice(16, 176)),
              "q6_k": (210, slice(0, 192)), "iq4_nl": (18, None), "iq4_xs": (136, None)}  # the IQ4 book: no m


def file_blocks(name: str, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    from pagedserve.model.gguf_rewrite import quantize_as

    qtype = GGMLQuantizationType[name.upper()]
    return torch.from_numpy(np.ascontiguousarray(quantize_as(w.numpy(), qtype))), int(qtype)


@pytest.mark.parametrize("name", list(FILE_TYPES))
@pytest.mark.parametrize("n,k", [(96, 512), (13, 1536)])
def test_op_on_file_types_matches_the_dequantised_reference(name: str, n: int, k: int) -> None:
    """As test_op_matches_dequantised_reference. The op sums code * d * x and m * x (Q6_K:
    m = -32 d per 16 values) as separate terms, so the bound takes |w| + 2|m| per weight,
    m read by dequantising the blocks with every code zeroed."""
    blocks, qtype = file_blocks(name, weights(n, k, seed=n))
    bias = torch.randn(n)
    layer = QuantLinear(blocks, qtype, bias, activations="int8")
    block_bytes, codes = FILE_TYPES[name]
    m = 0.0
    if codes is not None:
        zeroed = blocks.clone().reshape(n, -1, block_bytes)
        zeroed[..., codes] = 0
        m = dequantize_blocks(zeroed.reshape(n, -1), qtype).double().abs()
    w = dequantize_blocks(blocks, qtype).double()
    x_all = torch.randn(64, k) * torch.rand(64, 1) * 3
    x_all[2] = 0
    for rows in (1, 3, 5, 7, 64):
        x = x_all[:rows]
        q, s = quantize_activations(x)
        xd = (q.double().reshape(*s.shape, BLOCK) * s.double()[..., None]).reshape(x.shape)
        ref = xd @ w.T + bias.double()
        magnitude = xd.abs() @ (w.abs() + 2 * m).T + bias.double().abs()
        bound = (2 * k // BLOCK + 4) * 2.0**-24 * magnitude + 1e-30
        excess = ((layer(x).double() - ref).abs() - bound).max().item()
        assert excess <= 0, f"{name} {n}x{k} rows {rows}: error exceeds the bound by {excess:.3g}"


@pytest.mark.parametrize("name", list(FILE_TYPES))
def test_file_types_bits_do_not_depend_on_batch_threads_or_instruction_set(name) -> None:
    n = 8 * 4 * 3 + 13
    blocks, qtype = file_blocks(name, weights(n, 512, seed=3))
    layer = QuantLinear(blocks, qtype, torch.randn(n), activations="int8")
    results = outputs_on_every_path(layer, torch.randn(300, 512), (300, 64, 17, 7, 6, 5, 4, 3, 1))
    for y in results:
        assert torch.equal(y, results[0][: y.shape[0]])
