"""Linear layers with oneDNN-prepacked weights against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.llama import Linear, can_pack_weights


def test_the_pinned_torch_packs_by_default():
    # torch==2.13.0 (CPU) ships oneDNN: the default engine path is the packed one.
    assert can_pack_weights()


def _pair(n_in: int, n_out: int, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    layer = Linear(n_in, n_out, bias=bias).requires_grad_(False)
    weight = layer.weight.detach().clone()
    b = layer.bias.detach().clone() if bias else None
    layer.pack()
    return layer, weight, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 64, 300])
@torch.inference_mode()
def test_packed_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer, weight, b = _pair(576, 960, bias)
    x = torch.randn(rows, 576)
    out = layer(x)
    assert out.shape == (rows, 960)
    # fp32 either way; only the summation order differs.
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (2048, 8192), (8192, 2048)])
@torch.inference_mode()
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(n_in, n_out):
    # A request decoding alone is a one-row product; in a batch, one row of many. oneDNN
    # takes another kernel for one row when K is large on AVX-512 CPUs (K >= 1,536 on AMD
    # EPYC Zen 5: other bits), which the layer avoids by never giving it one row.
    torch.manual_seed(n_in)
    layer, _, _ = _pair(n_in, n_out, False)
    x = torch.randn(300, n_in)
    full = layer(x)
    for rows in (1, 2, 3, 8, 33, 256):
        assert torch.equal(layer(x[:rows].clone()), full[:rows]), rows


@torch.inference_mode()
def test_packed_reads_non_contiguous_inputs():
    layer, weight, _ = _pair(576, 1536, False)
    x = torch.randn(8, 2 * 576)[:, ::2]
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_packing_drops_the_plain_weight_once():
    layer, _, _ = _pair(64, 32, False)
    packed = layer.packed_weight
    assert layer.weight is None and "weight" not in layer.state_dict()
    layer.pack()  # already packed: nothing to do
    assert layer.packed_weight is packed


def test_only_float32_is_packed():
    layer = Linear(8, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        layer.pack()


def test_tied_head_is_packed_and_the_embedding_kept(gguf_path):
    from pagedserve.model.loader import build_model, convert_gguf

    c = convert_gguf(gguf_path)
    model = build_model(c.config, c.state)
    assert c.config.tie_word_embeddings
    assert model.lm_head.weight is None and model.lm_head.packed_weight is not None
    assert model.embed.weight.shape == (c.config.vocab_size, c.config.hidden_size)
    assert all(m.weight is None for m in model.linear_layers())
    plain = build_model(c.config, c.state, pack=False)
    assert plain.lm_head.weight is plain.embed.weight
    hidden = torch.randn(3, c.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.logits(hidden), plain.logits(hidden), atol=1e-3, rtol=1e-5)
