"""16-bit float weights as stored: a bf16 / f16 safetensors folder and a GGUF's F16 / BF16
tensors run on the fp32 op's F16 / BF16 tiles (kernels/csrc/dequant_linear.cpp) with no
float32 copy of any matrix, in about the file's bytes, and give the tokens of the same
weights widened to fp32 (transformers', and pagedserve's own oneDNN fp32 path).

Bound on logits: the weights widen to fp32 exactly and every product is one fp32 fma, so
against transformers' fp32 forward of the same bf16 weights only the summation order
differs: within rtol = atol = 1e-4 (test_architectures.py's bound for fp32 checkpoints)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from gguf_samples import llama_gguf_from_hf
from model_utils import fp32_matrices, greedy_generate, prefill_logits, resident_bytes
from pagedserve.model.gguf_file import read_tensors
from pagedserve.model.loader import gguf_header, load_model
from pagedserve.model.quant import QuantEmbedding, QuantLinear

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# Resident weights against the file's tensor bytes: the tiles pad rows to whole tiles of 8
# and norms are fp32, nothing else is added.
MEMORY_RATIO = 1.1


def file_tensor_bytes(folder) -> int:
    return sum(t.nbytes for f in folder.glob("*.safetensors") for t in load_file(f).values())


def transformers_greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("dtype,tied", [(torch.bfloat16, True), (torch.float16, False)])
@torch.inference_mode()
def test_a_half_folder_runs_as_stored_with_transformers_tokens(gguf_path, tmp_path, dtype, tied):
    tokenizer = gguf_header(gguf_path).tokenizer  # any tokenizer.json will do
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, tie_word_embeddings=tied, **TINY)
    stored = transformers.LlamaForCausalLM(config).to(dtype).eval()
    stored.save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    reference = stored.float()  # the stored weights widened to fp32: the model the file defines

    ours = load_model(tmp_path, keep_blocks=True)
    model = ours.model
    name = "BF16" if dtype == torch.bfloat16 else "F16"
    assert isinstance(model.embed, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert (model.lm_head.packed is model.embed.packed) == tied
    assert fp32_matrices(model) == []
    assert model.describe_weights() == f"9 {name} as stored (fp32 arithmetic); embedding {name} as stored"
    assert resident_bytes(model) <= MEMORY_RATIO * file_tensor_bytes(tmp_path)

    ids = torch.randint(0, tokenizer.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    tokens = greedy_generate(model, ids[:12], 12)
    assert tokens == transformers_greedy(reference, ids[:12], 12)
    assert tokens == greedy_generate(load_model(tmp_path).model, ids[:12], 12)  # the oneDNN fp32 path


def test_the_engine_serves_a_bf16_folder_as_stored_by_default_batch_invariant(gguf_path, tmp_path, caplog):
    import logging

    from engine_utils import assert_all_blocks_free, check_busy_batch
    from pagedserve import LLM

    tokenizer = gguf_header(gguf_path).tokenizer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, **TINY)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.llm_engine"):
        llm = LLM(model=str(tmp_path), kv_cache_memory="16MiB", max_model_len=256)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: "))
    assert line == "weights: 9 BF16 as stored (fp32 arithmetic); embedding BF16 as stored", line
    check_busy_batch(llm)
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def tiny_llama(gguf_path):
    """A tiny random Llama on the shipped tokenizer's vocabulary, in fp32."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=gguf_header(gguf_path).tokenizer.vocab_size,
                                      tie_word_embeddings=True, **TINY)
    return transformers.LlamaForCausalLM(config).eval()


def gguf_tensor_bytes(path) -> int:
    return sum(t.raw.nbytes for t in read_tensors(path))


@torch.inference_mode()
def test_an_f16_gguf_runs_as_stored_with_transformers_tokens(tiny_llama, gguf_path, tmp_path):
    path = tmp_path / "tiny-f16.gguf"
    llama_gguf_from_hf(path, tiny_llama, gguf_path, lambda name, shape: T.F16 if len(shape) == 2 else T.F32)
    model = load_model(path, use_cache=False, keep_blocks=True).model
    assert fp32_matrices(model) == []
    assert model.describe_weights() == "9 F16 as stored (fp32 arithmetic); embedding F16 as stored"
    assert resident_bytes(model) <= MEMORY_RATIO * gguf_tensor_bytes(path)
    reference = copy.deepcopy(tiny_llama).half().float()  # the file's weights widened to fp32
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(prefill_logits(model, ids), reference(torch.tensor([ids])).logits[0],
                               rtol=1e-4, atol=1e-4)
    assert greedy_generate(model, ids[:12], 12) == transformers_greedy(reference, ids[:12], 12)


def half_mix(name: str, shape: tuple[int, ...]) -> T:
    """Attention in F16, the MLP in BF16, the tied embedding (and head) Q8_0, norms F32."""
    if len(shape) == 1:
        return T.F32
    if name == "token_embd.weight":
        return T.Q8_0
    return T.F16 if ".attn_" in name else T.BF16


@pytest.fixture(scope="module")
def mixed_half_gguf(tiny_llama, gguf_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-mix.gguf"
    llama_gguf_from_hf(path, tiny_llama, gguf_path, half_mix)
    return path


@pytest.mark.parametrize("quantization, arithmetic", [("none", "fp32"), ("gguf", "int8")])
@torch.inference_mode()
def test_a_ggufs_f16_and_bf16_tensors_run_as_stored_beside_its_blocks(mixed_half_gguf, quantization, arithmetic):
    path = mixed_half_gguf
    model = load_model(path, use_cache=False, keep_blocks=True, quantization=quantization).model
    assert fp32_matrices(model) == []
    # Two layers: q/k/v as one F16 matrix and o F16, gate_up and down BF16; the head on the
    # embedding's Q8_0 blocks. F16 / BF16 have no int8 form: fp32 arithmetic either way.
    assert model.describe_weights() == ("4 F16 as stored (fp32 arithmetic), 4 BF16 as stored (fp32 arithmetic), "
                                        f"1 on Q8_0 blocks ({arithmetic} arithmetic); embedding on Q8_0 blocks")
    assert resident_bytes(model) <= MEMORY_RATIO * gguf_tensor_bytes(path)
    if quantization == "none":  # the same model as the file inflated to fp32: its tokens
        ids = [1, 504, 3458, 282, 4649, 314]
        dense = load_model(path, use_cache=False).model
        assert greedy_generate(model, ids, 8) == greedy_generate(dense, ids, 8)
