"""MXFP4 (model/mxfp4.py): the blocks against gguf's reference quantiser and dequantiser and
against transformers' own conversion of a gpt-oss checkpoint's layout, then the native
kernels on them (kernels/csrc: dequant_linear, quant_linear, moe_experts) against float64
references of their arithmetic, bit for bit, and a GGUF file holding MXFP4 experts.

The kernels' AVX-512 paths mirror the AVX2 ones; `outputs_on_every_path` runs each op on the
widest path this CPU has and held to AVX2, and the test summary (conftest.py) names the
paths that actually ran, so an AVX2-only machine says it proved nothing about AVX-512.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from test_dequant_linear import sequential_fma_reference
from test_moe_gguf import GGUF_MOE, load_config
from test_moe_int8 import fma32
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from engine_utils import greedy_tokens
from kernel_paths import outputs_on_every_path
from pagedserve.kernels import resolve_kernels
from pagedserve.model.gguf_file import read_tensors
from pagedserve.model.gguf_rewrite import add_tensor_as, finish
from pagedserve.model.gguf_write import write_gguf
from pagedserve.model.loader import load_model
from pagedserve.model.moe import MoE, QuantExperts, route
from pagedserve.model.moe_config import MoEConfig
from pagedserve.model.mxfp4 import BOOK, MXFP4, blocks_from_hf, half_scale
from pagedserve.model.quant import (QuantEmbedding, QuantLinear, dequantize_blocks, quantize_activations,
                                    quantize_blocks)

resolve_kernels("native")  # a broken build fails these tests rather than skipping them


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    w[0, :32] = 0  # an all-zero block: e = 0
    w[-1, 3] = 25.0  # an outlier owns its block's exponent; the block's others round to 0
    # Exact ties between codes (0.75 = between 0.5 and 1, 2.5, 5) and values past 6 * scale.
    w[1, 32:64] = torch.tensor([0.75, -0.75, 1.25, -2.5, 5.0, 7.9, -7.9, 3.0] * 4)
    return w


def test_quantiser_and_dequantiser_are_ggufs():
    w = weights(37, 96, seed=0)
    blocks = quantize_blocks(w, MXFP4)
    assert blocks.dtype == torch.uint8 and blocks.shape == (37, 3 * 17)
    np.testing.assert_array_equal(blocks.numpy(), quantize(w.numpy(), T.MXFP4))
    np.testing.assert_array_equal(dequantize_blocks(blocks, MXFP4).numpy(),
                                  dequantize(blocks.numpy(), T.MXFP4).reshape(37, 96))
    # Every value is the real one: an E2M1 code times the block's 2^(e - 127).
    values = dequantize_blocks(blocks, MXFP4).reshape(37, 3, 32).double()
    unit = torch.exp2(blocks.reshape(37, 3, 17)[..., :1].double() - 127)
    assert torch.isin(values / unit, torch.tensor(FP4_VALUES, dtype=torch.float64)).all()


def test_every_scale_byte_and_code_reads_as_gguf_reads_it():
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (256, 17), generator=g, dtype=torch.uint8)
    raw[:, 0] = torch.arange(256)  # e = 0 (2^-127, subnormal) .. 255 (12 * 2^127 overflows to inf, as in gguf)
    with np.errstate(over="ignore"):
        want = dequantize(raw.numpy(), T.MXFP4)
    np.testing.assert_array_equal(dequantize_blocks(raw, MXFP4).numpy(), want)
    assert half_scale(torch.tensor([0, 1, 127, 254], dtype=torch.uint8)).tolist() == [2.0**-128, 2.0**-127, 0.5,
                                                                                          2.0**126]


def test_a_gpt_oss_checkpoints_blocks_become_the_same_bits_transformers_reads():
    g = torch.Generator().manual_seed(2)
    hf_blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)  # [experts, out, K / 32, 16]
    hf_scales = torch.randint(110, 135, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = blocks_from_hf(hf_blocks, hf_scales)
    assert ours.shape == (3, 10, 4 * 17) and torch.equal(ours.reshape(3, 10, 4, 17)[..., 0], hf_scales)
    theirs = convert_moe_packed_tensors(hf_blocks, hf_scales, dtype=torch.float32)  # [experts, in, out]
    assert torch.equal(dequantize_blocks(ours.reshape(30, -1), MXFP4).reshape(3, 10, 128), theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="scales"):
        blocks_from_hf(hf_blocks, hf_scales[..., :3])
    with pytest.raises(ValueError, match="uint8"):
        blocks_from_hf(hf_blocks, hf_scales.float())


@pytest.mark.parametrize("path", ["auto", "avx2"])
@pytest.mark.parametrize("n,k", [(40, 576), (13, 64)])
def test_fp32_op_is_the_sequential_fp32_product_of_the_real_values(n, k, path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NATIVE_ISA", path)
    blocks = quantize_blocks(weights(n, k, seed=n), MXFP4)
    bias = torch.randn(n)
    layer = QuantLinear(blocks, MXFP4, bias, activations="fp32")
    x = torch.randn(11, k) * torch.rand(11, 1) * 3
    x[2] = 0
    ref = sequential_fma_reference(x, dequantize_blocks(blocks, MXFP4), bias)
    for rows in (1, 2, 3, 4, 5, 6, 7, 11):  # in registers below 4 rows (6 on AVX-512), the GEMM path above
        assert torch.equal(layer(x[:rows]), ref[:rows]), rows
    # One-hot rows read single weights back: the tiles hold the blocks' values.
    eye = torch.eye(k)[:64]
    assert torch.equal(QuantLinear(blocks, MXFP4, activations="fp32")(eye), dequantize_blocks(blocks, MXFP4)[:, :64].T)


def test_an_embedding_reads_its_rows_back_out_of_the_tiles():
    blocks = quantize_blocks(weights(45, 320, seed=5), MXFP4)
    ids = torch.tensor([[44, 0, 7], [1, 1, 31]])
    assert torch.equal(QuantEmbedding(blocks, MXFP4)(ids), dequantize_blocks(blocks, MXFP4)[ids])


def int8_reference(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """quant_linear's arithmetic on MXFP4, exactly: the activations quantised as the op does,
    then per block in order acc = fma(dot, d * activation scale, acc) with dot the exact
    integer dot of the int8 codes and the book's integers, d = 2^(e - 128); then + bias."""
    q, s = quantize_activations(x)
    n, nb = blocks.shape[0], x.shape[1] // 32
    b = blocks.reshape(n, nb, 17)
    qs = b[..., 1:].long()
    book = BOOK[torch.cat([qs & 15, qs >> 4], dim=-1)].double()  # [n, nb, 32]
    dots = torch.einsum("mbk,nbk->mnb", q.double().reshape(-1, nb, 32), book)  # exact: |dot| < 2^17
    d = half_scale(b[..., 0])  # [n, nb]
    acc = torch.zeros(x.shape[0], n)
    for j in range(nb):
        acc = fma32(dots[..., j].float(), d[None, :, j] * s[:, j, None], acc)
    return acc + bias


@pytest.mark.parametrize("path", ["auto", "avx2"])
@pytest.mark.parametrize("n,k", [(37, 256), (8 * 4 * 3 + 5, 96)])
def test_int8_op_is_the_exact_integer_dot_scaled_per_block(n, k, path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NATIVE_ISA", path)
    blocks = quantize_blocks(weights(n, k, seed=k), MXFP4)
    bias = torch.randn(n)
    layer = QuantLinear(blocks, MXFP4, bias, activations="int8")
    x = torch.randn(9, k) * torch.rand(9, 1) * 3
    x[1, 5] = 40.0  # an activation outlier
    x[2] = 0
    ref = int8_reference(x, blocks, bias)
    for rows in (1, 4, 5, 7, 9):
        assert torch.equal(layer(x[:rows]), ref[:rows]), rows


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_rows_bits_do_not_depend_on_batch_threads_or_instruction_set(activations):
    n, k = 8 * 4 * 3 + 13, 320  # three whole 4-tile groups, then a partial group and tile
    layer = QuantLinear(quantize_blocks(weights(n, k, seed=7), MXFP4), MXFP4, torch.randn(n), activations=activations)
    results = outputs_on_every_path(layer, torch.randn(100, k), (100, 17, 7, 6, 5, 4, 3, 1))
    for y in results:
        assert torch.equal(y, results[0][: y.shape[0]])


E, H, I, TOP_K = 5, 96, 160, 2


def expert_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
    return {name: torch.randn(*shape, generator=g) * 0.3 for name, shape in shapes.items()}


def test_fp32_experts_on_mxfp4_blocks_are_the_dequantised_float_experts_exactly():
    """moe_experts on MXFP4 tiles: each row's gate, up and down the sequential fp32 products
    of the real values, silu_mul's product between, results added in ascending expert id as
    one fma of the router weight each."""
    stacks = {name: QuantExperts.from_float(w, MXFP4, "fp32") for name, w in expert_weights(3).items()}
    dense = {name: dequantize_blocks(quantize_blocks(w.reshape(-1, w.shape[-1]), MXFP4), MXFP4).reshape(w.shape)
             for name, w in expert_weights(3).items()}
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, H, generator=g)
    weights, experts = route(torch.randn(6, E, generator=g) * 3, TOP_K, normalize=True)
    args = [a for s in (stacks["gate"], stacks["up"], stacks["down"]) for a in (s.packed, s.qtype)]
    got = torch.ops.pagedserve.moe_experts(x, experts, weights, *args, I)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in sorted(zip(weights[t].tolist(), experts[t].tolist()), key=lambda pair: pair[1]):
            row = x[t:t + 1]
            gu = torch.cat([sequential_fma_reference(row, dense["gate"][e], None),
                            sequential_fma_reference(row, dense["up"][e], None)], dim=-1)
            y = sequential_fma_reference(torch.ops.pagedserve.silu_mul(gu), dense["down"][e], None)[0]
            want[t] = fma32(torch.tensor(w).expand_as(y), y, want[t])
    assert torch.equal(got, want)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_an_moe_layer_takes_mxfp4_experts_by_qtype(activations):
    """The route a model takes: QuantExperts with qtype MXFP4 in the MoE layer, against the
    same layer on the dequantised fp32 experts (torch; int8 activations round more)."""
    config = MoEConfig(num_experts=E, top_k=TOP_K, expert_size=I, normalize_top_k=True, sparse_layers=(0,))
    router = torch.nn.Linear(H, E, bias=False)
    float_moe, block_moe = MoE(config, H, router), MoE(config, H, router)
    for name, w in expert_weights(5).items():
        experts = QuantExperts.from_float(w, MXFP4, activations)
        setattr(block_moe, name, experts)
        getattr(float_moe, name).weight.data = dequantize_blocks(
            quantize_blocks(w.reshape(-1, w.shape[-1]), MXFP4), MXFP4).reshape(w.shape)
    assert "expert stack on MXFP4 blocks" in block_moe.weight_paths()[0]
    x = torch.randn(7, H)
    with torch.no_grad():
        want = float_moe(x)
        tol = 1e-5 if activations == "fp32" else 2e-2
        torch.testing.assert_close(block_moe(x), want, rtol=tol, atol=tol * want.abs().max().item())


def mxfp4_experts(name: str, shape: tuple[int, ...]) -> T:
    """gpt-oss's GGUF types: experts MXFP4, the router F32, the rest Q8_0."""
    if "ffn_gate_inp" in name:
        return T.F32
    return T.MXFP4 if "_exps" in name else T.Q8_0


def test_a_gguf_file_holds_mxfp4_tensors_as_written_and_experts_run_on_its_blocks(tmp_path):
    w = expert_weights(6)["down"]
    path = tmp_path / "experts.gguf"
    writer = GGUFWriter(path, "llama")
    add_tensor_as(writer, "blk.0.ffn_down_exps.weight", w.numpy(), T.MXFP4)
    finish(writer)
    (tensor,) = read_tensors(path)
    assert tensor.qtype == T.MXFP4 and tensor.shape == (E, H, I)
    blocks = torch.from_numpy(np.array(tensor.raw)).reshape(E, H, -1)
    assert torch.equal(blocks, quantize_blocks(w.reshape(E * H, I), MXFP4).reshape(E, H, -1))
    dense = dequantize_blocks(blocks.reshape(E * H, -1), MXFP4).reshape(E, H, I)
    assert np.array_equal(tensor.to_float32(), dense.numpy())
    experts = QuantExperts(blocks, MXFP4, "fp32")  # the file's blocks [experts, out, row bytes], as the loader keeps them
    x = torch.randn(3, I)
    for e in (0, E - 1):
        got = torch.ops.pagedserve.dequant_linear(x, experts.packed[e], MXFP4, H, None)
        assert torch.equal(got, sequential_fma_reference(x, dense[e], None))


@pytest.mark.slow  # ~60 s on 2 busy cores: a model written, loaded twice and decoded
def test_a_gguf_with_mxfp4_experts_loads_them_on_blocks_with_the_dequantised_models_tokens(gguf_path, tmp_path):
    from test_moe import make_reference

    tokenizer = load_model(gguf_path).tokenizer
    ref = make_reference("qwen3_moe", tokenizer.vocab_size, **GGUF_MOE, moe_intermediate_size=256, head_dim=64)
    path = tmp_path / "mxfp4.gguf"
    written = write_gguf(path, load_config(ref, tmp_path), dict(ref.state_dict()), gguf_path, mxfp4_experts)
    assert written["blk.0.ffn_gate_exps.weight"] == "MXFP4"
    tensor = {t.name: t for t in read_tensors(path)}["blk.0.ffn_down_exps.weight"]
    assert tensor.qtype == T.MXFP4 and np.isfinite(tensor.to_float32()).all()
    blocks = load_model(path, use_cache=False, keep_blocks=True)
    moe = blocks.model.layers[0].moe
    assert isinstance(moe.gate, QuantExperts) and (moe.gate.qtype, moe.down.qtype) == (MXFP4, MXFP4)
    dense = load_model(path, use_cache=False)
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    assert greedy_tokens(blocks, prompts, 6) == greedy_tokens(dense, prompts, 6)
