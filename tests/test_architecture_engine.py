"""Phi-3 and Gemma 2/3 through the whole engine: the prefix cache, copy-on-write,
preemption, speculative decoding, structured output and LoRA each give a sliding-window
(and, for Gemma 2, soft-capped) model the greedy tokens it gives without them. Every
layer keeps its whole K/V (the window only masks), so a cached prefix is as valid as on
a Llama model (model/variants.py)."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine_utils import assert_all_blocks_free, make_llm
from pagedserve import SamplingParams, StructuredOutputs
from pagedserve.bench.lora_adapters import write_random_adapter
from pagedserve.model.loader import gguf_header, load_model

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, sliding_window=24)
MODELS = {
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        attn_logit_softcapping=0.5, final_logit_softcapping=5.0, query_pre_attn_scalar=24, initializer_range=0.1)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        initializer_range=0.1)),
}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# KV bytes of one 16-token block of TINY at fp32.
BLOCK_BYTES = 3 * 2 * 2 * 16 * 4 * 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# Gemma 2 (windows, soft-caps, four norms) in the default run; the others marked slow.
@pytest.fixture(scope="module", params=[pytest.param(name, marks=[] if name == "gemma2" else pytest.mark.slow)
                                        for name in MODELS])
def arch_model(request, gguf_path, tmp_path_factory):
    config_cls, model_cls, extra = MODELS[request.param]
    tokenizer = gguf_header(gguf_path).tokenizer  # the shipped model's, any would do
    torch.manual_seed(0)
    ref = model_cls(config_cls(vocab_size=tokenizer.vocab_size, **TINY, **extra))
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder)
    tokenizer.save(folder)
    return load_model(folder)


def prompts(tokenizer) -> list[list[int]]:
    """Prompts past the window, two sharing a 3-block prefix (prefix-cache hits, a shared block)."""
    shared = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 6)[:48]
    return [shared + tokenizer.encode(" and then it ran away"), shared + tokenizer.encode(" so the dog slept on"),
            tokenizer.encode("A list of colours: red, green, blue, red, green, blue, red, green, " * 2),
            tokenizer.encode("Once upon a time")]


def run(llm, ids, params=GREEDY, **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False, **kw)]


def test_engine_features_keep_the_greedy_tokens(arch_model):
    ids = prompts(arch_model.tokenizer)
    base = [run(make_llm(arch_model, kv_cache_memory=200 * BLOCK_BYTES), [p])[0] for p in ids]

    cached = make_llm(arch_model, kv_cache_memory=200 * BLOCK_BYTES)
    assert run(cached, ids) == base and run(cached, ids) == base  # the second time from the prefix cache
    assert cached.stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(cached)

    # 14 blocks for 4 prompts of up to 5 blocks each: requests are preempted and recomputed.
    tight = make_llm(arch_model, kv_cache_memory=14 * BLOCK_BYTES, max_num_batched_tokens=64, max_num_seqs=8)
    assert run(tight, ids * 2) == base * 2
    assert tight.stats()["num_preemptions"] > 0
    assert_all_blocks_free(tight)

    spec = make_llm(arch_model, kv_cache_memory=200 * BLOCK_BYTES, speculative_config=NGRAM)
    assert run(spec, ids) == base
    assert spec.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(spec)


def test_structured_output_and_lora(arch_model, tmp_path):
    ids = prompts(arch_model.tokenizer)
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=["left", "right"]))
    plain = make_llm(arch_model, kv_cache_memory=200 * BLOCK_BYTES)
    alone = [plain.generate(p, choice, use_tqdm=False)[0].outputs[0].text for p in ids]
    assert set(alone) <= {"left", "right"}
    spec = make_llm(arch_model, kv_cache_memory=200 * BLOCK_BYTES, speculative_config=NGRAM)
    assert [o.outputs[0].text for o in spec.generate(ids, choice, use_tqdm=False)] == alone

    # LoRA on the dense layers (q/k/v, o, gate/up, down of the fused matrices).
    adapter = write_random_adapter(tmp_path / "adapter", arch_model.config, rank=8, alpha=16, seed=3, b_std=0.5)
    base = run(plain, ids)
    lora = make_llm(arch_model, kv_cache_memory=200 * BLOCK_BYTES, enable_lora=True, lora_modules={"a": str(adapter)})
    adapted_alone = [run(lora, [p], lora_name="a")[0] for p in ids]
    mixed = run(lora, ids + ids, lora_name=["a"] * len(ids) + [None] * len(ids))
    assert mixed == adapted_alone + base
    assert adapted_alone != base  # the adapter counts
    assert_all_blocks_free(lora)
