"""The fp32 linear op on GGUF blocks (kernels/csrc/dequant_linear.cpp): the fp32 model a
GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K ... Q6_K / IQ4_NL / IQ4_XS matrices define, computed from
the blocks, and likewise on F16 / BF16 weights as stored (each widens to fp32 exactly).

Its arithmetic is defined exactly: each output is fma(x[k], w[k], acc) for k = 0 .. K-1 from
acc = 0, with w[k] the dequantised weight (exact in fp32; gguf's own dequantiser gives the
reference for the types beyond quantize_blocks'), then + bias. The
reference below runs that in float64 (the product is exact there and the sum rounds once
to float64, then to fp32), which can differ from one fp32 rounding only when the float64
sum lands on an fp32 tie: never in these fixed-seed cases, so the op must equal it bit for
bit. Then every path the op takes (in-register dequantisation below 4 rows, the
dequantise-to-L1 GEMM above, AVX2 or AVX-512, any row count or thread count) must give
each row the same bits.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kernel_paths import outputs_on_every_path
from pagedserve.kernels import resolve_kernels
from pagedserve.model.gguf_rewrite import quantize_as
from pagedserve.model.quant import (BF16, QTYPES, QuantEmbedding, QuantLinear, dequantize_blocks, half_blocks,
                                    quantize_blocks)

resolve_kernels("native")  # loads the op library; a broken build fails here rather than skipping

BLOCK_TYPES = ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
               "f16", "bf16"]
SUPER_BLOCKS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")  # rows of whole 256-value super-blocks


def blocks_of(name: str, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """w quantised to GGML type `name`: (blocks, type id)."""
    qtype = int(T[name.upper()])
    if name in QTYPES:
        return quantize_blocks(w, qtype), qtype
    raw = quantize_as(w.numpy(), T(qtype))
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), qtype  # F16 comes as float16


def width(name: str, k: int) -> int:
    """k, or the next whole number of K-quant super-blocks."""
    return -(-k // 256) * 256 if name in SUPER_BLOCKS else k


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w[0, :32] = 0  # an all-zero block
    w[-1, 3] = 25.0  # an outlier owns its block's scale
    return w


def sequential_fma_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    xd, wd = x.double(), w.double()
    for k in range(x.shape[1]):
        acc = (acc.double() + xd[:, k : k + 1] * wd[:, k][None, :]).float()
    return acc if bias is None else acc + bias


@pytest.fixture
def isa():
    """Restores the op's instruction-set choice after a test that forces one."""
    before = os.environ.get("PAGEDSERVE_NATIVE_ISA")
    yield
    if before is None:
        os.environ.pop("PAGEDSERVE_NATIVE_ISA", None)
    else:
        os.environ["PAGEDSERVE_NATIVE_ISA"] = before


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("n,k", [(40, 576), (13, 64), (9, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["auto", "avx2"])
def test_op_is_the_sequential_fp32_product_of_the_dequantised_weights(name, n, k, with_bias, path, isa) -> None:
    k = width(name, k)
    blocks, qtype = blocks_of(name, weights(n, k, seed=n + k))
    bias = torch.randn(n) if with_bias else None
    layer = QuantLinear(blocks, qtype, bias, activations="fp32")
    x = torch.randn(11, k) * torch.rand(11, 1) * 3
    x[2] = 0
    os.environ["PAGEDSERVE_NATIVE_ISA"] = path
    ref = sequential_fma_reference(x, dequantize_blocks(blocks, qtype), bias)
    for rows in (1, 2, 3, 4, 5, 6, 7, 11):  # in registers below 4 rows (6 on AVX-512), the GEMM path above
        assert torch.equal(layer(x[:rows]), ref[:rows]), (name, n, k, rows)
    # One-hot rows read single weights back: the packed tiles hold the file's values.
    eye = torch.eye(k)[:64]
    assert torch.equal(QuantLinear(blocks, qtype, activations="fp32")(eye), dequantize_blocks(blocks, qtype)[:, :64].T)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_an_embedding_reads_its_rows_back_out_of_the_tiles_its_tied_head_uses(name) -> None:
    blocks, qtype = blocks_of(name, weights(45, width(name, 320), seed=5))
    embed = QuantEmbedding(blocks, qtype)
    ids = torch.tensor([[44, 0, 7], [8, 8, 31]])
    assert torch.equal(embed(ids), dequantize_blocks(blocks, qtype)[ids])
    head = QuantLinear(embed, qtype, activations="fp32")
    assert head.packed is embed.packed and head.out_features == 45
    with pytest.raises(RuntimeError, match="out of range"):
        embed(torch.tensor([48]))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_a_rows_bits_do_not_depend_on_batch_threads_or_instruction_set(name) -> None:
    n, k = 8 * 4 * 3 + 5, width(name, 320)  # three whole 4-tile groups, then a partial tile
    blocks, qtype = blocks_of(name, weights(n, k, seed=7))
    layer = QuantLinear(blocks, qtype, torch.randn(n), activations="fp32")
    results = outputs_on_every_path(layer, torch.randn(300, k), (300, 64, 17, 6, 5, 4, 3, 1))
    for y in results:
        assert torch.equal(y, results[0][: y.shape[0]])


def test_layer_keeps_leading_dims_and_matches_the_dense_fp32_layer() -> None:
    """Against torch's own fp32 linear on the dequantised matrix: equal up to summation order."""
    blocks = quantize_blocks(weights(96, 576, seed=3), QTYPES["q4_1"])
    layer = QuantLinear(blocks, QTYPES["q4_1"], activations="fp32")
    x = torch.randn(2, 9, 576)
    y = layer(x)
    assert y.shape == (2, 9, 96)
    dense = torch.nn.functional.linear(x, dequantize_blocks(blocks, QTYPES["q4_1"]))
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-4)
    assert layer(torch.empty(0, 576)).shape == (0, 96)


def test_op_rejects_mismatched_arguments() -> None:
    layer = QuantLinear.from_float(weights(16, 64, seed=0), QTYPES["q8_0"])
    with pytest.raises(RuntimeError, match="input features"):
        torch.ops.pagedserve.dequant_linear(torch.randn(2, 96), layer.packed, QTYPES["q8_0"], 16, None)
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.pagedserve.dequant_linear(torch.randn(1, 64), layer.packed, QTYPES["q4_1"], 16, None)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.pagedserve.dequant_linear(torch.randn(1, 64), layer.packed, QTYPES["q8_0"], 40, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedserve.dequant_linear(torch.randn(1, 64).double(), layer.packed, QTYPES["q8_0"], 16, None)
    with pytest.raises(ValueError, match="activations"):
        QuantLinear(layer.packed.new_zeros(16, 68), QTYPES["q8_0"], activations="bf16")
    with pytest.raises(RuntimeError, match="quant_repack: row bytes"):
        torch.ops.pagedserve.quant_repack([layer.packed.new_zeros(16, 100)], int(T.Q4_K))
    with pytest.raises(RuntimeError, match="quant_repack: qtype"):
        torch.ops.pagedserve.quant_repack([layer.packed.new_zeros(16, 100)], int(T.IQ2_XS))  # no kernel


def test_half_weights_have_only_the_fp32_form_and_whole_blocks() -> None:
    w = weights(16, 64, seed=1).to(torch.bfloat16)
    blocks = half_blocks(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (16, 128) and blocks.data_ptr() == w.data_ptr()
    assert half_blocks(w.float()) is None and half_blocks(w[:, :48].contiguous()) is None  # fp32; K not 32-aligned
    layer = QuantLinear(blocks, BF16, activations="fp32")
    with pytest.raises(ValueError, match="fp32 activations only"):
        QuantLinear(blocks, BF16, activations="int8")
    with pytest.raises(RuntimeError, match="no int8 form"):
        torch.ops.pagedserve.quant_linear(torch.randn(1, 64), layer.packed, BF16, 16, None)
