"""gpt-oss against transformers: a tiny random GptOssForCausalLM saved by transformers,
loaded through pagedserve's HF-folder path, gives transformers' logits and greedy tokens
on the model alone and through the engine, on the native kernels and on pure torch.

The checkpoint makes each piece count: random biases everywhere and sinks around the
scores' size, a sliding window of 8 under 40-token prompts, YaRN past its original context,
and a SwiGLU limit the gate and up projections cross."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from engine_utils import assert_all_blocks_free, make_llm
from model_utils import greedy_generate, prefill_logits
from pagedserve import SamplingParams
from pagedserve.attention.backend import ReferenceBackend
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.model.config import ModelConfig
from pagedserve.model.loader import gguf_header, load_model
from pagedserve.model.moe import ExpertStack, QuantExperts
from pagedserve.model.quant import QTYPES, QuantLinear

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
            initializer_range=0.1, swiglu_limit=1.0,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0})
# fp32 on both sides: the tests of the other architectures' tiny checkpoints hold the same.
LOGITS = dict(rtol=1e-4, atol=1e-4)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(gguf_path, tmp_path_factory):
    """(transformers' model, the folder it saved, prompts of 40 and 23 tokens)."""
    tokenizer = gguf_header(gguf_path).tokenizer  # the shipped model's, any would do
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(transformers.GptOssConfig(vocab_size=tokenizer.vocab_size, **TINY)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("bias", "sinks")):  # initialised to zero (the experts' biases) or small
                p.normal_(0, 1.0 if name.endswith("sinks") else 0.5)
    folder = tmp_path_factory.mktemp("gpt-oss")
    ref.save_pretrained(folder)
    tokenizer.save(folder)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tokenizer.vocab_size, (n,), generator=gen).tolist() for n in (40, 23)]
    return ref, folder, prompts


@torch.inference_mode()
def reference_greedy(ref, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens, each from a whole forward over the sequence so far."""
    ids, out = list(ids), []
    for _ in range(n):
        tok = int(ref(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_the_config_reads_every_gpt_oss_piece(checkpoint):
    c = ModelConfig.from_hf_config(checkpoint[1] / "config.json")
    assert (c.architecture, c.attention_bias, c.o_bias, c.attention_sinks) == ("gpt_oss", True, True, True)
    assert (c.sliding_window, c.sliding_layers) == (8, (True, False, True))
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_theta == 150000.0
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.sparse_layers) == (4, 2, 64, (0, 1, 2))
    assert moe.softmax_after_top_k and moe.biases and moe.activation == "clamped_swiglu"
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 1.0)


@pytest.mark.parametrize("kernels", ["native", "torch"])
@torch.inference_mode()
def test_logits_and_greedy_tokens_match_transformers(checkpoint, kernels):
    ref, folder, prompts = checkpoint
    loaded = load_model(folder)
    loaded.model.set_kernels(kernels)
    backend = NativePagedAttention() if kernels == "native" else ReferenceBackend()
    ids = prompts[0]
    expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, backend), expected, **LOGITS)
    assert greedy_generate(loaded.model, ids, NEW_TOKENS, backend) == reference_greedy(ref, ids)


@torch.inference_mode()
def test_each_piece_changes_the_logits(checkpoint):
    """Sinks, the window and the SwiGLU clamp each move transformers' logits, so the match
    above covers them."""
    ref, _, prompts = checkpoint
    ids = torch.tensor([prompts[0]])
    base = ref(ids).logits
    changes = {
        "sinks": lambda m: [layer.self_attn.sinks.fill_(-1e4) for layer in m.model.layers],
        "window": lambda m: setattr(m.config, "sliding_window", 64),
        "clamp": lambda m: [setattr(layer.mlp.experts, "limit", 1e4) for layer in m.model.layers],
    }
    for name, change in changes.items():
        changed = copy.deepcopy(ref)
        change(changed)
        assert not torch.allclose(changed(ids).logits, base, atol=1e-3), name


# The native paged engine in the default run; pure torch is checked there on the model alone.
@pytest.mark.parametrize("kernels,kv_layout", [
    ("native", "paged"), pytest.param("torch", "paged", marks=pytest.mark.slow),
    pytest.param("native", "contiguous", marks=pytest.mark.slow)], ids=["native", "torch", "contiguous-native"])
def test_the_engine_gives_transformers_greedy_tokens(checkpoint, kernels, kv_layout):
    ref, folder, prompts = checkpoint
    llm = make_llm(load_model(folder), kernels=kernels, kv_layout=kv_layout, kv_cache_memory=1 << 22)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference_greedy(ref, p) for p in prompts]
    if kv_layout == "paged":
        assert_all_blocks_free(llm)


@torch.inference_mode()
def test_int8_experts_take_the_clamped_swiglu_and_biases(checkpoint):
    """--quantization q8_0 makes the experts QuantExperts; gpt-oss's run each expert's
    product on its own tiles (a QuantLinear's op, bias included), its activation between."""
    ref, folder, prompts = checkpoint
    fp32, q8 = load_model(folder), load_model(folder, quantization="q8_0")
    fp32.model.set_kernels("native")
    q8.model.set_kernels("native")
    moe = q8.model.layers[0].moe
    assert all(isinstance(m, QuantExperts) for m in (moe.gate, moe.up, moe.down)) and not moe.fused_op()
    assert any("expert stack on Q8_0 blocks (int8 arithmetic)" in p for p in moe.weight_paths())
    weight = torch.randn(4, 48, 64)
    bias = torch.randn(4, 48)
    stack = QuantExperts.from_float(weight, QTYPES["q8_0"], "int8", bias)
    x = torch.randn(5, 64)
    assert torch.equal(stack.expert(2, x), QuantLinear.from_float(weight[2], QTYPES["q8_0"], bias[2])(x))
    ids = prompts[0]
    want = prefill_logits(fp32.model, ids, NativePagedAttention())
    got = prefill_logits(q8.model, ids, NativePagedAttention())
    # 8-bit weights move every logit a little (a token whose top-k experts tie closely may
    # route elsewhere): near the fp32 model's row by row, not its bits.
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.median() > 0.999 and cosine.min() > 0.95
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()
    assert not torch.equal(got, want)


def test_fp32_experts_are_packed_with_their_biases(checkpoint):
    loaded = load_model(checkpoint[1])
    moe = loaded.model.layers[1].moe
    assert isinstance(moe.gate, ExpertStack) and moe.gate.weight is None and moe.gate.experts[0].bias is not None


def test_unimplemented_gpt_oss_settings_are_refused_by_name(checkpoint, tmp_path):
    cfg = json.loads((checkpoint[1] / "config.json").read_text())
    path = tmp_path / "config.json"
    for bad, message in (({"quantization_config": {"quant_method": "mxfp4"}},
                          "quantization_config \\(quant_method 'mxfp4'\\) is not implemented for gpt_oss"),
                         ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
                          "layer_types \\['chunked_attention'\\] are not implemented"),
                         ({"swiglu_limit": -1.0}, "swiglu_limit must be a finite number > 0")):
        path.write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_config(path)
