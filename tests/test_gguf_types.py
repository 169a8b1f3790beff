"""The GGML types users' files hold: each is written (model/gguf_rewrite.py) and read back,
and each a native kernel takes runs on its own blocks with no fp32 copy of any matrix, giving the tokens of the same file inflated to
fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from model_utils import fp32_matrices
from pagedserve.model.gguf_file import SUPPORTED_TYPES, GGUFFile, read_tensors
from pagedserve.model.gguf_rewrite import IQ4_NL_VALUES, quantize_iq4_nl, quantize_iq4_xs, quantize_k, rewrite_gguf
from pagedserve.model.quant import ConcatLinear, QuantEmbedding, QuantLinear


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quant_writer_makes_blocks_gguf_reads_back_close_to_the_values(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :256] = 0  # an all-zero super-block: scales 0
    raw = quantize_k(x, qtype)
    got = dequantize(raw, qtype).reshape(x.shape)
    assert np.array_equal(got[0, :256], np.zeros(256))
    # Round to nearest on a grid of (max - min) / 15 (31, 63 for 5 and 6 bits; Q2_K's 3 and
    # Q3_K's amax / 4), plus the 6-bit (Q6_K: 8-bit, Q2_K: 4-bit) quantisation of each block's
    # scale against the super-block's.
    bound = {T.Q2_K: 0.6, T.Q3_K: 0.3, T.Q4_K: 0.12, T.Q5_K: 0.06, T.Q6_K: 0.04}[qtype]
    span = np.abs(x).reshape(6, -1, 256).max(-1, keepdims=True)
    assert (np.abs(got - x).reshape(6, -1, 256) <= bound * span).all()


def test_iq4_xs_writer_makes_blocks_gguf_reads_back_on_the_book():
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :256] = 0  # an all-zero super-block: scale 0
    raw = quantize_iq4_xs(x)
    assert raw.shape == (6, 2 * 136)
    got = dequantize(raw, T.IQ4_XS).reshape(x.shape)
    assert np.array_equal(got[0, :256], np.zeros(256))
    # Each block of 32's scale is 6 bits against the super-block's; its values the nearest
    # book entries (the book's steps are at most 24 of its 240-wide span).
    span = np.abs(x).reshape(6, -1, 256).max(-1, keepdims=True)
    assert (np.abs(got - x).reshape(6, -1, 256) <= 0.12 * span).all()


def test_iq4_nl_quantiser_picks_the_nearest_book_value():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    raw = quantize_iq4_nl(x)
    got = dequantize(raw, T.IQ4_NL).reshape(x.shape)
    d = raw.reshape(4, 2, 18)[..., :2].copy().view(np.float16).astype(np.float32)  # [4, 2, 1]
    book = d * IQ4_NL_VALUES.astype(np.float32)  # [4, 2, 16]: each block's representable values
    nearest = np.abs(x.reshape(4, 2, 32, 1) - book[:, :, None, :]).min(-1)
    assert np.allclose(np.abs(got.reshape(4, 2, 32) - x.reshape(4, 2, 32)), nearest, atol=1e-6)


# A Q4_K_M-like mix on SmolLM2's shapes. Rows 576 wide are not whole K-quant super-blocks,
# so llama-quantize stores them Q5_0 (Q8_0 where it aimed at Q6_K: attn_v and the tied
# embedding), which makes qkv a matrix of two types; ffn_down (1,536 wide) takes the K-quants
# in turn (Q6_K, Q4_K, Q3_K, Q2_K, IQ4_XS: as Q4_K_M's "more bits" rule, Q3_K_M, Q2_K and
# IQ4_XS files do);
# IQ4_NL for the gate/up pair, and Q5_1 for layer 0's, so every type the kernels take but
# MXFP4 (an expert type, whose model files tests/test_mxfp4.py writes) is in the file.
def q4_k_m_like(name: str, shape: tuple[int, ...], qtype: T) -> T:
    if len(shape) == 1:
        return qtype
    if "attn_v" in name or name == "token_embd.weight":
        return T.Q8_0
    if "ffn_gate" in name or "ffn_up" in name:
        return T.Q5_1 if name.startswith("blk.0.") else T.IQ4_NL
    if "ffn_down" in name:
        return (T.Q6_K, T.Q4_K, T.Q3_K, T.Q2_K, T.IQ4_XS)[int(name.split(".")[1]) % 5]
    if name.startswith("blk.1."):
        return T.Q4_1
    return T.Q5_0


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, gguf_path):
    path = tmp_path_factory.mktemp("gguf") / "smollm2-mixed.gguf"
    written = rewrite_gguf(gguf_path, path, q4_k_m_like)
    assert {"Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "F32"} \
        == set(written.values())
    return path


def test_every_supported_type_reads_back_what_was_written(mixed_gguf):
    types = {t.qtype for t in GGUFFile(mixed_gguf).tensors()}
    assert types <= SUPPORTED_TYPES
    assert {T.Q5_0, T.IQ4_NL, T.IQ4_XS, T.Q5_1, T.Q2_K, T.Q3_K} <= SUPPORTED_TYPES
    fast = read_tensors(mixed_gguf)  # the tensor table alone, from the header walk
    for ours, theirs in zip(fast, GGUFFile(mixed_gguf).tensors()):
        assert (ours.name, ours.qtype, ours.shape) == (theirs.name, theirs.qtype, theirs.shape)
        assert np.asarray(ours.raw).tobytes() == np.asarray(theirs.raw).tobytes(), ours.name


def test_a_mixed_file_runs_on_native_blocks_with_the_dense_models_tokens(mixed_gguf):
    from engine_utils import greedy_tokens

    from pagedserve.model.loader import load_model

    blocks = load_model(mixed_gguf, use_cache=False, keep_blocks=True)
    model = blocks.model
    assert isinstance(model.embed, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert fp32_matrices(model) == []
    qkv = model.layers[2].qkv
    assert isinstance(qkv, ConcatLinear) and [p.qtype for p in qkv.parts] == [T.Q5_0, T.Q8_0]
    assert [p.out_features for p in qkv.parts] == [576 + 192, 192]
    kinds = {path: getattr(m, "qtype", None) for path, m in model.named_linears()}
    assert kinds["layers.0.gate_up"] == T.Q5_1 and kinds["layers.2.gate_up"] == T.IQ4_NL
    assert kinds["layers.1.o"] == T.Q4_1 and kinds["layers.2.o"] == T.Q5_0
    assert [kinds[f"layers.{i}.down"] for i in range(5)] == [T.Q6_K, T.Q4_K, T.Q3_K, T.Q2_K, T.IQ4_XS]

    dense = load_model(mixed_gguf, use_cache=False)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    assert greedy_tokens(blocks, prompts) == greedy_tokens(dense, prompts)


@pytest.mark.parametrize("quantization, arithmetic", [("auto", "int8"), ("none", "fp32")])
def test_the_start_up_log_says_which_path_each_matrix_takes(mixed_gguf, caplog, quantization, arithmetic):
    import logging

    from pagedserve.engine_config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="pagedserve.engine.llm_engine"):
        LLMEngine(EngineConfig(model=str(mixed_gguf), kv_cache_memory="16MiB", max_model_len=256,
                               quantization=quantization))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: "))
    # 30 layers. Q5_0: 29 q/k parts, 29 o; Q8_0: 30 v parts, the tied head; IQ4_NL: 29
    # gate_up pairs; Q6_K / Q4_K / Q3_K / Q2_K / IQ4_XS: down; layer 0's gate_up Q5_1, layer
    # 1's q/k and o Q4_1.
    a = f"({arithmetic} arithmetic)"
    assert line == f"weights: 58 on Q5_0 blocks {a}, 31 on Q8_0 blocks {a}, 29 on IQ4_NL blocks {a}, " \
                   f"6 on Q6_K blocks {a}, 6 on Q4_K blocks {a}, 6 on Q3_K blocks {a}, 6 on Q2_K blocks {a}, " \
                   f"6 on IQ4_XS blocks {a}, 2 on Q4_1 blocks {a}, 1 on Q5_1 blocks {a}; " \
                   "embedding on Q8_0 blocks", line
