"""The GGML types users' files hold: each is written (model/gguf_rewrite.py) and read back,
and the ones a native kernel can take (Q5_0 and IQ4_NL widened exactly to Q8_0 blocks) run
on it with no fp32 copy of the matrices, giving the tokens of the same file inflated to fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagedserve.model.gguf_file import SUPPORTED_TYPES, GGUFFile
from pagedserve.model.gguf_rewrite import IQ4_NL_VALUES, quantize_iq4_nl, rewrite_gguf
from pagedserve.model.quant import QuantEmbedding, QuantLinear, widen_to_q8_0


@pytest.mark.parametrize("qtype", [T.Q5_0, T.IQ4_NL])
def test_widening_to_q8_0_keeps_every_value(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 320)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0
    raw = quantize(x, qtype) if qtype == T.Q5_0 else quantize_iq4_nl(x)
    widened = widen_to_q8_0(torch.from_numpy(raw.copy()), int(qtype)).numpy()
    assert widened.shape == (6, 320 // 32 * 34)
    assert np.array_equal(dequantize(widened, T.Q8_0), dequantize(raw, qtype).reshape(6, 320))


def test_iq4_nl_quantiser_picks_the_nearest_book_value():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    raw = quantize_iq4_nl(x)
    got = dequantize(raw, T.IQ4_NL).reshape(x.shape)
    d = raw.reshape(4, 2, 18)[..., :2].copy().view(np.float16).astype(np.float32)  # [4, 2, 1]
    book = d * IQ4_NL_VALUES.astype(np.float32)  # [4, 2, 16]: each block's representable values
    nearest = np.abs(x.reshape(4, 2, 32, 1) - book[:, :, None, :]).min(-1)
    assert np.allclose(np.abs(got.reshape(4, 2, 32) - x.reshape(4, 2, 32)), nearest, atol=1e-6)


# A Q4_K_M-like mix on SmolLM2's shapes: rows 576 wide are not whole K-quant super-blocks,
# so llama-quantize stores them Q5_0 (Q8_0 where it aimed at Q6_K: attn_v); IQ4_NL for the
# gate/up pair; ffn_down keeps the file's Q4_1; the embedding (and tied head) Q8_0.
def q4_k_m_like(name: str, shape: tuple[int, ...], qtype: T) -> T:
    if len(shape) == 1:
        return qtype
    if "attn_v" in name or name == "token_embd.weight":
        return T.Q8_0
    if "ffn_gate" in name or "ffn_up" in name:
        return T.IQ4_NL
    if "ffn_down" in name:
        return qtype
    return T.Q5_0


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, gguf_path):
    path = tmp_path_factory.mktemp("gguf") / "smollm2-mixed.gguf"
    written = rewrite_gguf(gguf_path, path, q4_k_m_like)
    assert {"Q5_0", "Q8_0", "IQ4_NL", "Q4_1", "F32"} == set(written.values())
    return path


def test_every_supported_type_reads_back_what_was_written(mixed_gguf):
    types = {t.qtype for t in GGUFFile(mixed_gguf).tensors()}
    assert types <= SUPPORTED_TYPES
    assert {T.Q5_0, T.IQ4_NL, T.Q5_1, T.Q2_K, T.Q3_K} <= SUPPORTED_TYPES


def test_a_mixed_file_runs_on_native_blocks_with_the_dense_models_tokens(mixed_gguf):
    from engine_utils import make_llm

    from pagedserve import SamplingParams
    from pagedserve.model.loader import load_model

    blocks = load_model(mixed_gguf, use_cache=False, keep_blocks=True)
    model = blocks.model
    assert isinstance(model.embed, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    kinds = {path: (type(m).__name__, getattr(m, "qtype", None)) for path, m in model.named_linears()}
    assert all(kind == "QuantLinear" for kind, _ in kinds.values()), kinds  # no fp32 matrix anywhere
    assert kinds["layers.0.qkv"][1] == kinds["layers.0.gate_up"][1] == 8  # Q5_0 + Q8_0, IQ4_NL: as Q8_0
    assert kinds["layers.0.down"][1] == 3  # Q4_1, as stored

    dense = load_model(mixed_gguf, use_cache=False)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    ours = [o.outputs[0].token_ids for o in make_llm(blocks).generate(prompts, greedy, use_tqdm=False)]
    theirs = [o.outputs[0].token_ids for o in make_llm(dense).generate(prompts, greedy, use_tqdm=False)]
    assert ours == theirs


def test_the_start_up_log_says_which_path_each_matrix_takes(mixed_gguf, caplog):
    import logging

    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="pagedserve.engine.llm_engine"):
        LLMEngine(EngineConfig(model=str(mixed_gguf), kv_cache_memory="16MiB", max_model_len=256))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: "))
    # 30 layers: qkv, o, gate_up and the tied head on Q8_0 blocks; down on Q4_1.
    assert line == "weights: 91 on Q8_0 blocks (fp32 arithmetic), 30 on Q4_1 blocks (fp32 arithmetic); " \
                   "embedding on Q8_0 blocks", line
