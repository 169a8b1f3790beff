"""Mixtral, Qwen3-MoE and OLMoE against transformers: tiny random checkpoints written by
transformers itself, loaded back through pagedserve's HF-folder path; then the engine's
features on an MoE model, each against the same requests run without the feature."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from engine_utils import assert_all_blocks_free, busy_batch_tokens, make_llm
from model_utils import prefill_logits

from pagedserve import SamplingParams
from pagedserve.model.loader import load_model
from pagedserve.model.moe import ExpertStack, group_by_expert, route
from pagedserve.sampling_params import StructuredOutputs

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
MOE_ARCHITECTURES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # Layer 1 dense (mlp_only_layers), experts narrower than the dense MLP, renormalised.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=3, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=3,
                       moe_intermediate_size=40, norm_topk_prob=True, head_dim=24)),
    # Every second layer sparse, the top k not renormalised.
    "qwen3_moe-sparse-step": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                              dict(decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=48, norm_topk_prob=False)),
    # q/k norms over the whole projections, and q, k, v clipped.
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(num_experts=8, num_experts_per_tok=2, clip_qkv=1.5, eos_token_id=2, pad_token_id=1)),
}
# fp32 against fp32 on the same inputs: only the order of sums differs (matmul blocking).
LOGITS_BOUND = dict(rtol=1e-4, atol=1e-4)


def make_reference(name: str, vocab_size: int, **overrides) -> torch.nn.Module:
    """A tiny random model whose routing is decisive: routers and experts drawn wider than
    transformers' init (std 0.02 leaves every router probability near 1/E, where rounding
    could pick another expert, and the experts' output near zero)."""
    config_cls, model_cls, extra = MOE_ARCHITECTURES[name]
    torch.manual_seed(0)
    ref = model_cls(config_cls(vocab_size=vocab_size, **{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if pname.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif "experts" in pname:
                p.normal_(0, 0.15)
    return ref


def save_reference(name: str, tokenizer, folder) -> torch.nn.Module:
    ref = make_reference(name, tokenizer.vocab_size)
    ref.save_pretrained(folder)
    tokenizer.save(folder)
    return ref


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_model(gguf_path).tokenizer  # any tokenizer.json will do


@pytest.mark.parametrize("name", list(MOE_ARCHITECTURES))
@torch.inference_mode()
def test_tiny_moe_checkpoint_matches_transformers(name, tokenizer, tmp_path):
    ref = save_reference(name, tokenizer, tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.architecture == ref.config.model_type
    sparse = [i for i, layer in enumerate(ours.model.layers) if layer.moe is not None]
    assert sparse == {"qwen3_moe": [0, 2], "qwen3_moe-sparse-step": [1]}.get(name, [0, 1])
    ids = torch.randint(0, tokenizer.vocab_size, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours.model, ids), expected, **LOGITS_BOUND)

    # Greedy through the engine: the tokens transformers' own generate picks.
    prompts = [ids[:40], ids[50:57]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in make_llm(ours).generate(prompts, greedy, use_tqdm=False)]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == want


def test_grouping_by_expert_keeps_token_order_within_each_expert():
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    experts = torch.tensor([[2, 0], [0, 3], [2, 3]])
    groups = group_by_expert(weights, experts, 5)
    assert groups.counts == [2, 0, 2, 2, 0]
    assert groups.rows.tolist() == [0, 1, 0, 2, 1, 2]
    assert groups.weights.tolist() == pytest.approx([0.4, 0.7, 0.6, 0.5, 0.3, 0.5])


def test_routing_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    w, e = route(logits, 2, normalize=False)
    assert e.tolist() == [[0, 1]] and w[0].tolist() == pytest.approx(probs[:2].tolist())
    w, _ = route(logits, 2, normalize=True)
    assert w[0].tolist() == pytest.approx((probs[:2] / probs[:2].sum()).tolist())
    # gpt-oss: the top k logits, then a softmax over those k alone.
    w, e = route(logits + torch.tensor([[0.0, 0.0, 0.0, 5.0]]), 2, normalize=True, softmax_after_top_k=True)
    assert e.tolist() == [[3, 0]] and w[0].tolist() == pytest.approx(torch.softmax(torch.tensor([4.0, 2.0]), 0).tolist())


@pytest.fixture(scope="module")
def qwen3_moe(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-moe")
    save_reference("qwen3_moe", tokenizer, folder)
    return load_model(folder)


def kv_block_bytes(loaded) -> int:
    c = loaded.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4 * 16


def test_moe_prefix_caching_and_preemption_keep_each_requests_tokens(qwen3_moe):
    assert any(isinstance(layer.moe.gate, ExpertStack) for layer in qwen3_moe.model.layers if layer.moe)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = busy_batch_tokens(make_llm(qwen3_moe, kv_cache_memory=256 * kv_block_bytes(qwen3_moe)), greedy)
    # 16 blocks for six requests of up to ~100 tokens: they preempt one another.
    llm = make_llm(qwen3_moe, kv_cache_memory=16 * kv_block_bytes(qwen3_moe), max_num_batched_tokens=64,
                   max_num_seqs=6)
    assert busy_batch_tokens(llm, greedy) == roomy
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_moe_parallel_samples_share_blocks_and_reproduce(qwen3_moe):
    llm = make_llm(qwen3_moe, kv_cache_memory=256 * kv_block_bytes(qwen3_moe))
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    alone = llm.generate("Name a colour:", params, use_tqdm=False)[0]
    busy = llm.generate(["Name a colour:", "Something else entirely", "Third"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in busy.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    assert_all_blocks_free(llm)


def test_moe_self_draft_speculation_gives_the_tokens_of_plain_decoding(qwen3_moe):
    """The draft is the target's first two layers (one sparse, one dense); the target
    verifies its drafts several rows a sequence through the experts."""
    prompts = [list(range(100, 120)) * 3, [5, 6, 7, 5, 6, 7, 5, 6]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(qwen3_moe, kv_cache_memory=256 * kv_block_bytes(qwen3_moe))
    spec = make_llm(qwen3_moe, kv_cache_memory=256 * kv_block_bytes(qwen3_moe), speculative_config={
        "method": "draft_model", "model": "self:2", "num_speculative_tokens": 3})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)] == want
    assert spec.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(spec)


def test_moe_structured_output_is_valid_json_of_the_schema(qwen3_moe):
    llm = make_llm(qwen3_moe, kv_cache_memory=256 * kv_block_bytes(qwen3_moe))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputs(json=schema))
    alone = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0].text
    assert set(json.loads(alone)) == {"ok"}
    busy = llm.generate(["Answer:", "Something else"], params, use_tqdm=False)[0].outputs[0].text
    assert busy == alone
    assert_all_blocks_free(llm)


def test_bad_moe_settings_are_refused_by_name(tmp_path):
    from pagedserve.model.config import ModelConfig

    base = {"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
    path = tmp_path / "config.json"
    for bad, message in (({"num_experts_per_tok": 5}, "top_k must be an integer in \\[1, 4\\]"),
                         ({"num_local_experts": 0}, "num_experts must be"),
                         ({"clip_qkv": -1.0}, "clip_qkv must be")):
        path.write_text(json.dumps({**base, **bad}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_config(path)
    path.write_text(json.dumps({**base, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32,
                                "mlp_only_layers": [0]}))
    assert ModelConfig.from_hf_config(path).moe.sparse_layers == (1,)


def test_tensor_parallelism_and_moe_lora_are_refused(qwen3_moe, tmp_path):
    from safetensors.torch import save_file

    from pagedserve.distributed.sharding import TPShard
    from pagedserve.model.lora import load_peft_adapter

    with pytest.raises(ValueError, match="does not split a mixture of experts"):
        TPShard(qwen3_moe.config, 0, 2)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(2, 64),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(40, 2)},
              tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="mixture of experts"):
        load_peft_adapter(tmp_path, qwen3_moe.config, max_rank=8)
