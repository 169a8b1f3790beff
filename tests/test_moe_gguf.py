"""MoE experts on a GGUF file's blocks: the native grouped op (kernels/csrc/moe_experts.cpp)
against torch on the dequantised weights, on both CPU paths, and tiny Mixtral / Qwen3-MoE /
OLMoE GGUFs written from transformers checkpoints (model/gguf_write.py), whose tokens on the
blocks are those of the same file dequantised to fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_moe import LOGITS_BOUND, make_reference

from engine_utils import greedy_tokens
from model_utils import prefill_logits

from pagedserve.model.gguf_file import read_tensors
from pagedserve.model.gguf_rewrite import quantize_as
from pagedserve.model.gguf_write import write_gguf
from pagedserve.model.loader import load_model
from pagedserve.model.moe import QuantExperts, group_by_expert, route

E, H, I = 6, 256, 256  # K-quant rows are whole 256-value super-blocks


def expert_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: T) -> torch.Tensor:
    return torch.from_numpy(quantize_as(rng.standard_normal(shape).astype(np.float32) * 0.2, qtype).copy())


def reference(x, weights, experts, dense: dict[str, torch.Tensor]) -> torch.Tensor:
    """torch on the dequantised experts, in float64: sum_j w_j * down(silu(gate x) * up x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in sorted(zip(weights[t].tolist(), experts[t].tolist()), key=lambda p: p[1]):
            xe = x[t].double()
            act = torch.nn.functional.silu(dense["gate"][e] @ xe) * (dense["up"][e] @ xe)
            out[t] += w * (dense["down"][e] @ act)
    return out


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_0, T.Q4_1), (T.Q5_K, T.Q4_0, T.Q5_1)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_native_experts_match_torch_on_the_dequantised_blocks_on_both_cpu_paths(types, monkeypatch):
    rng = np.random.default_rng(int(types[0]))
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
    blocks = {k: expert_blocks(rng, s, t) for (k, s), t in zip(shapes.items(), types)}
    stacks = {k: QuantExperts(b, t) for (k, b), t in zip(blocks.items(), types)}
    dense = {k: torch.from_numpy(dequantize(b.numpy(), t).reshape(shapes[k])).double()
             for (k, b), t in zip(blocks.items(), types)}
    x = torch.randn(9, H)
    weights, experts = route(torch.randn(9, E) * 3, 2, normalize=True)
    g, u, d = stacks["gate"], stacks["up"], stacks["down"]

    def run(rows: slice = slice(None)) -> torch.Tensor:
        return torch.ops.pagedserve.moe_experts(x[rows], experts[rows], weights[rows], g.packed, g.qtype, u.packed,
                                                u.qtype, d.packed, d.qtype, I)

    got = run()
    want = reference(x, weights, experts, dense)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(run(slice(3, 4))[0], got[3])  # a row alone: the same bits as in the batch
    monkeypatch.setenv("PAGEDSERVE_NATIVE_ISA", "avx2")
    assert torch.equal(run(), got)


def test_native_experts_read_only_the_selected_experts_blocks():
    rng = np.random.default_rng(3)
    stacks = [QuantExperts(expert_blocks(rng, s, T.Q4_K), T.Q4_K) for s in ((E, I, H), (E, I, H), (E, H, I))]
    x = torch.randn(4, H)
    experts = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0]])
    weights = torch.full((4, 2), 0.5)
    before = torch.ops.pagedserve.moe_experts(x, experts, weights, *[a for s in stacks for a in (s.packed, s.qtype)], I)
    for s in stacks:  # every other expert's scales become NaN: reading any of them would show
        s.packed[[1, 3, 4, 5]] = 0xFF
    after = torch.ops.pagedserve.moe_experts(x, experts, weights, *[a for s in stacks for a in (s.packed, s.qtype)], I)
    assert torch.equal(before, after) and torch.isfinite(after).all()


def test_native_experts_refuse_bad_expert_ids():
    rng = np.random.default_rng(4)
    stacks = [QuantExperts(expert_blocks(rng, s, T.Q8_0), T.Q8_0) for s in ((E, I, H), (E, I, H), (E, H, I))]
    args = [a for s in stacks for a in (s.packed, s.qtype)]
    with pytest.raises(RuntimeError, match="expert id 6 out of range"):
        torch.ops.pagedserve.moe_experts(torch.randn(1, H), torch.tensor([[0, 6]]), torch.ones(1, 2), *args, I)


def test_grouped_torch_path_adds_in_expert_order_like_the_reference():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    weights, experts = route(torch.randn(5, 4), 2, normalize=False)
    groups = group_by_expert(weights, experts, 4)
    assert sorted(groups.rows.tolist()) == sorted([t for t in range(5) for _ in range(2)])
    assert sum(groups.counts) == 10


# Q4_K_M-like: experts' gate/up Q4_K, down Q6_K (llama-quantize's "more bits" rule), the
# attention Q8_0 / Q5_0, the router kept F32 (llama.cpp never quantises ffn_gate_inp).
def q4_k_m_like(name: str, shape: tuple[int, ...]) -> T:
    if "ffn_gate_inp" in name:
        return T.F32
    if "_exps" in name:
        return T.Q6_K if "down" in name else T.Q4_K
    if "attn_v" in name or name in ("token_embd.weight", "output.weight"):
        return T.Q8_0
    return T.Q5_0


GGUF_MOE = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=I)


# Qwen3-MoE by default (a dense layer beside sparse ones); the others ~40 s each on 2 cores.
@pytest.mark.parametrize("name", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe",
                                  pytest.param("olmoe", marks=pytest.mark.slow)])
def test_a_tiny_moe_gguf_runs_its_experts_on_blocks_with_the_dequantised_models_tokens(name, gguf_path, tmp_path):
    tokenizer = load_model(gguf_path).tokenizer
    extra = {"moe_intermediate_size": I, "head_dim": 64} if name == "qwen3_moe" else {}
    ref = make_reference(name, tokenizer.vocab_size, **GGUF_MOE, **extra)
    path = tmp_path / f"{name}.gguf"
    hf = dict(ref.state_dict())
    written = write_gguf(path, load_config(ref, tmp_path), hf, gguf_path, q4_k_m_like)
    assert written["blk.0.ffn_gate_exps.weight"] == "Q4_K" and written["blk.0.ffn_down_exps.weight"] == "Q6_K"
    assert {t.name: t.shape for t in read_tensors(path)}["blk.0.ffn_up_exps.weight"][0] == ref.config.num_experts

    blocks = load_model(path, use_cache=False, keep_blocks=True)
    moe = blocks.model.layers[0].moe
    assert isinstance(moe.gate, QuantExperts) and (moe.gate.qtype, moe.down.qtype) == (T.Q4_K, T.Q6_K)
    # quantization none: the experts multiply in fp32, as the dense layers on blocks do.
    assert "expert stack on Q4_K blocks (fp32 arithmetic)" in blocks.model.describe_weights()
    dense = load_model(path, use_cache=False)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    assert greedy_tokens(blocks, prompts, 12) == greedy_tokens(dense, prompts, 12)


def load_config(ref, folder):
    from pagedserve.model.config import ModelConfig

    ref.config.save_pretrained(folder)
    return ModelConfig.from_hf_config(folder / "config.json")


def test_an_f32_mixtral_gguf_gives_transformers_logits(gguf_path, tmp_path):
    """The writer's names, llama's q/k permutation and the MoE metadata, read back exactly."""
    tokenizer = load_model(gguf_path).tokenizer
    ref = make_reference("mixtral", tokenizer.vocab_size)
    path = tmp_path / "mixtral-f32.gguf"
    write_gguf(path, load_config(ref, tmp_path), dict(ref.state_dict()), gguf_path, lambda name, shape: T.F32)
    ours = load_model(path, use_cache=False)
    assert ours.config.architecture == "llama" and ours.config.moe.num_experts == 4
    ids = list(range(200, 260))
    with torch.inference_mode():
        torch.testing.assert_close(prefill_logits(ours.model, ids), ref(torch.tensor([ids])).logits[0], **LOGITS_BOUND)
