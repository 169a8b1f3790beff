"""Multi-LoRA serving: PEFT adapters made by `peft` on the embedded model's architecture,
checked against transformers + peft on the same GGUF, alone and in batches that mix
adapters with the base model; prefix-cache isolation; loading and unloading under load.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import REFERENCE_TEXTS
from engine_utils import assert_all_blocks_free, make_llm
from model_utils import BLOCK_SIZE, new_kv_caches, step_metadata
from pagedserve import SamplingParams
from pagedserve.attention.selector import default_backend_name, get_backend
from pagedserve.bench.lora_adapters import write_random_adapter
from pagedserve.engine_config import EngineConfig
from pagedserve.core.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from pagedserve.kernels import resolve_kernels
from pagedserve.model.loader import load_model
from pagedserve.model.lora import LoRASlots, fused_shapes, load_peft_adapter
from pagedserve.outputs import OutputAccumulator

# fp32 on both sides, as tests/test_model_reference.py (base model worst 6.8e-5 there);
# the adapters' deltas add a few more products summed in another order. Observed worst
# max |logit diff| 9.9e-5 over these prompts and adapters on 2026-12-01 (with B's spread
# 0.02; the test prints it); hold 1e-3.
LOGIT_ATOL = 1e-3
# name -> (rank, alpha, targets, use_rslora): every projection; PEFT's usual q/v; the MLP
# and o with rsLoRA scaling. "wide" is over the engine's max_lora_rank (16).
ADAPTERS = {
    "all8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "qv4": (4, 8, ("q_proj", "v_proj"), False),
    "mlp16": (16, 16, ("o_proj", "gate_proj", "up_proj", "down_proj"), True),
    "wide": (32, 32, ("q_proj",), False),
}
SERVED = ("all8", "qv4", "mlp16")
# B's spread: large enough that each adapter changes greedy continuations.
B_STD = 0.1
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [REFERENCE_TEXTS[1], REFERENCE_TEXTS[3], REFERENCE_TEXTS[4]]


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory, loaded) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(write_random_adapter(root / name, loaded.config, rank=r, alpha=a, targets=t, seed=i,
                                           use_rslora=rs, b_std=B_STD))
            for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def reference(hf_model, adapter_paths):
    """transformers + peft: a copy of the session's reference model with the served adapters."""
    peft = pytest.importorskip("peft")
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), adapter_paths[SERVED[0]], adapter_name=SERVED[0])
    for name in SERVED[1:]:
        model.load_adapter(adapter_paths[name], adapter_name=name)
    return model.eval()


@torch.inference_mode()
def reference_logits(reference, name: str | None, ids: list[int]) -> torch.Tensor:
    if name is None:
        with reference.disable_adapter():
            return reference(torch.tensor([ids])).logits[0]
    reference.set_adapter(name)
    return reference(torch.tensor([ids])).logits[0]


@torch.inference_mode()
def reference_greedy(reference, name: str | None, ids: list[int], eos: int) -> list[int]:
    def run():
        out = reference.generate(input_ids=torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 pad_token_id=eos)
        return out[0, len(ids):].tolist()
    if name is None:
        with reference.disable_adapter():
            return run()
    reference.set_adapter(name)
    return run()


@pytest.fixture(scope="module")
def prompt_ids(loaded) -> list[list[int]]:
    return [loaded.tokenizer.encode(p) for p in PROMPTS]


def lora_llm(loaded, adapter_paths, **options):
    return make_llm(loaded, enable_lora=True, lora_modules={n: adapter_paths[n] for n in SERVED}, **options)


# -- the layout and the delta ------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native-op", "torch"])
def test_fused_layout_matches_peft_per_projection(loaded, adapter_paths, native):
    """The fused A^T/B^T of one slot give, on the fused output, exactly each projection's
    B @ A @ x * scaling in its own slice (and zeros where the adapter has no pair), with
    the native op and with torch's segments."""
    config = loaded.config
    adapter = load_peft_adapter(adapter_paths["qv4"], config, 16)
    if native:
        resolve_kernels("native")  # loads the op library (an error, not a skip, if it cannot run)
    slots = LoRASlots(config, 2, 16, native=native)
    slots.add(7, adapter)
    shapes = fused_shapes(config)
    x = torch.randn(5, config.hidden_size)
    y = torch.randn(5, shapes["qkv"].out_features)
    before = y.clone()
    batch = slots.batch(np.array([0, -1, 0, 0, -1]))  # rows 1 and 4 run the base model
    batch.add(3, "qkv", x, y)
    peft_config = json.loads((Path(adapter_paths["qv4"]) / "adapter_config.json").read_text())
    scaling = peft_config["lora_alpha"] / peft_config["r"]
    tensors = load_file(Path(adapter_paths["qv4"]) / "adapter_model.safetensors")
    expected = before.clone()
    for proj, sub in (("q_proj", 0), ("v_proj", 2)):
        key = f"base_model.model.model.layers.3.self_attn.{proj}"
        a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
        offset, size = shapes["qkv"].slices[sub]
        expected[[0, 2, 3], offset:offset + size] += x[[0, 2, 3]] @ a.T @ b.T * scaling
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[[1, 4]], before[[1, 4]])
    # gate_up is not a target: nothing changes.
    z = torch.randn(5, shapes["gate_up"].out_features)
    z0 = z.clone()
    batch.add(3, "gate_up", x, z)
    assert torch.equal(z, z0)
    assert slots.batch(np.full(5, -1)) is None


@torch.inference_mode()
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_logits_match_peft_alone_and_in_a_mixed_batch(loaded, adapter_paths, reference, prompt_ids, kernels):
    """One forward over the three adapters and the base model, every position's logits
    against transformers + peft; then each sequence alone. Both kernel paths: the native
    one applies the deltas with lora_add_, the torch one with its segment GEMMs."""
    model = loaded.model
    kernels = resolve_kernels(kernels)
    model.set_kernels(kernels)
    backend = get_backend(default_backend_name(kernels))
    slots = LoRASlots(model.config, 4, 16, native=kernels == "native")
    for i, name in enumerate(SERVED):
        slots.add(i + 1, load_peft_adapter(adapter_paths[name], model.config, 16))
    names = [*SERVED, None]
    seqs = [prompt_ids[i % len(prompt_ids)] for i in range(len(names))]
    slot_of = {name: slots.slot_of[i + 1] for i, name in enumerate(SERVED)}

    def forward(batch_seqs, batch_names):
        lens = [len(s) for s in batch_seqs]
        tables, next_block = [], 1
        for n in lens:
            count = -(-n // BLOCK_SIZE)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        caches = new_kv_caches(model, next_block)
        meta = step_metadata([0] * len(lens), lens, tables)
        backend.prepare(meta)
        token_slots = np.repeat([slot_of[n] if n is not None else -1 for n in batch_names], lens)
        flat = torch.tensor([t for s in batch_seqs for t in s])
        positions = torch.cat([torch.arange(n) for n in lens])
        logits = model(flat, positions, caches, meta, backend, torch.arange(len(flat)), slots.batch(token_slots))
        return logits.split(lens)

    worst = 0.0
    mixed = forward(seqs, names)
    for ids, name, ours in zip(seqs, names, mixed):
        ref = reference_logits(reference, name, ids)
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"{name}: max |logit diff| {diff:.2e}"
        alone = forward([ids], [name])[0]
        assert (alone - ours).abs().max().item() < LOGIT_ATOL
    # The adapters do change the model: their logits are far from the base model's.
    base = reference_logits(reference, None, seqs[0])
    assert (mixed[0] - base).abs().max().item() > 0.5
    print(f"worst max |logit diff| vs transformers + peft: {worst:.2e}")


# -- the engine ------------------------------------------------------------------------


def test_greedy_matches_peft_alone_and_in_a_mixed_batch(loaded, adapter_paths, reference, prompt_ids):
    llm = lora_llm(loaded, adapter_paths)
    eos = llm.tokenizer.eos_token_id
    names = [*SERVED, None]
    expected = {(name, i): reference_greedy(reference, name, ids, eos)
                for name in names for i, ids in enumerate(prompt_ids[:2])}
    for (name, i), ref in expected.items():
        alone = llm.generate(prompt_ids[i], GREEDY, use_tqdm=False, lora_name=name)[0].outputs[0].token_ids
        assert alone[: len(ref)] == ref, (name, i)
    # Interleaved, so every step's rows mix all adapters and the base model.
    jobs = [(name, i) for i in range(2) for name in names] * 2
    outs = llm.generate([prompt_ids[i] for _, i in jobs], GREEDY, use_tqdm=False, lora_name=[n for n, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        ref = expected[(name, i)]
        assert out.outputs[0].token_ids[: len(ref)] == ref, (name, i)
    assert len({tuple(expected[(name, 0)]) for name in names}) == len(names)  # four different continuations
    assert_all_blocks_free(llm)


def test_quantised_layers_take_the_delta_too(adapter_paths, reference, prompt_ids):
    """`gguf` runs the file's Q4_1 blocks on the native kernels; the delta is added after
    them. The same request alone and in a mixed batch agrees, and the adapter's logits
    stay as close to transformers + peft as the quantised base model is to fp32
    (tests/test_quantized_model.py: median relative error < 4%)."""
    gguf = load_model(quantization="gguf")
    llm = make_llm(gguf, quantization="gguf", enable_lora=True, lora_modules={"all8": adapter_paths["all8"]})
    ids = prompt_ids[2]
    alone = llm.generate(ids, GREEDY, use_tqdm=False, lora_name="all8")[0].outputs[0].token_ids
    mixed = llm.generate([ids, ids, prompt_ids[0]], GREEDY, use_tqdm=False, lora_name=["all8", None, "all8"])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].token_ids != alone
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ours = llm.generate(ids, params, use_tqdm=False, lora_name="all8")[0].prompt_logprobs
    ref = torch.log_softmax(reference_logits(reference, "all8", ids), -1)
    errors = [abs(entry[tok].logprob - ref[pos - 1, tok].item()) / max(1.0, abs(ref[pos - 1, tok].item()))
              for pos, (tok, entry) in enumerate(zip(ids, ours)) if entry is not None]
    assert float(np.median(errors)) < 0.04, errors
    assert_all_blocks_free(llm)


def test_prefix_cache_never_shares_blocks_across_adapters(loaded, adapter_paths):
    llm = lora_llm(loaded, adapter_paths)
    prompt = llm.tokenizer.encode("You are a careful assistant. Answer briefly and precisely. " * 8)
    assert len(prompt) > 4 * BLOCK_SIZE
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_name="all8")[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_name="all8")[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_name="qv4")[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the cache is on
    assert other.metrics.num_cached_tokens == 0 and base.metrics.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in (first, other, base)}) == 3
    assert_all_blocks_free(llm)


def test_block_hash_keys_the_adapter():
    block = list(range(BLOCK_SIZE))
    base = extend_block_hashes([], block * 2, BLOCK_SIZE, 2, None)
    assert base[0] == hash_block(ROOT_HASH, block)  # the base model's keys are what they were
    one, two = (extend_block_hashes([], block * 2, BLOCK_SIZE, 2, None, lora_id) for lora_id in (1, 2))
    salted = extend_block_hashes([], block * 2, BLOCK_SIZE, 2, "tenant", 1)
    assert len({base[1], one[1], two[1], salted[1]}) == 4
    assert extend_block_hashes([], block * 2, BLOCK_SIZE, 2, None, 1) == one


def test_load_and_unload_under_load_leak_nothing(loaded, adapter_paths, prompt_ids):
    llm = make_llm(loaded, enable_lora=True, max_loras=2, lora_modules={"all8": adapter_paths["all8"]})
    engine = llm.engine
    alone = {name: llm.generate(prompt_ids[2], GREEDY, use_tqdm=False, lora_name=name)[0].outputs[0].token_ids
             for name in ("all8", None)}
    running = [engine.add_request(prompt_ids[i % 3], GREEDY, lora_name="all8" if i % 2 else None) for i in range(6)]
    accumulated = OutputAccumulator()
    for _ in range(3):
        for delta in engine.step():
            accumulated.add(delta)
    engine.add_lora("qv4", adapter_paths["qv4"])  # between steps, under load
    with pytest.raises(ValueError, match="max_loras"):
        engine.add_lora("mlp16", adapter_paths["mlp16"])
    with pytest.raises(ValueError, match="unfinished requests"):
        engine.remove_lora("all8")
    late = engine.add_request(prompt_ids[0], GREEDY, lora_name="qv4")
    for delta in engine.step():
        accumulated.add(delta)
    accumulated.add(engine.abort(late))
    engine.remove_lora("qv4")  # its only request was aborted
    with pytest.raises(ValueError, match="no LoRA adapter named 'qv4'"):
        engine.add_request(prompt_ids[0], GREEDY, lora_name="qv4")
    outputs = {}
    while engine.has_unfinished_requests():
        for out in map(accumulated.add, engine.step()):
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    for i, rid in enumerate(running):
        if i % 3 == 2:
            assert outputs[rid] == alone["all8" if i % 2 else None]
    engine.remove_lora("all8")
    # Reloaded under a new id, in the freed slot: same outputs, and no stale prefix hits.
    module = engine.add_lora("all8", adapter_paths["all8"])
    assert module.lora_id == 3
    again = llm.generate(prompt_ids[2], GREEDY, use_tqdm=False, lora_name="all8")[0]
    assert len(prompt_ids[2]) > BLOCK_SIZE
    assert again.outputs[0].token_ids == alone["all8"] and again.metrics.num_cached_tokens == 0
    assert_all_blocks_free(llm)


def test_bad_adapters_are_clear_value_errors(loaded, adapter_paths, tmp_path):
    llm = lora_llm(loaded, adapter_paths)
    engine = llm.engine
    with pytest.raises(ValueError, match="is not a PEFT adapter folder"):
        engine.add_lora("missing", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"rank 32 is above max_lora_rank \(16\)"):
        engine.add_lora("wide", adapter_paths["wide"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(open(adapter_paths["qv4"] + "/adapter_config.json").read())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        engine.add_lora("broken", str(broken))
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("all8", adapter_paths["all8"])
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_name="nope")
    with pytest.raises(ValueError, match="lora_name has 2 entries for 1 prompts"):
        llm.generate(["hi"], GREEDY, use_tqdm=False, lora_name=["all8", None])
    assert [m.name for m in engine.list_loras()] == list(SERVED)
    plain = make_llm(loaded)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate("hi", GREEDY, use_tqdm=False, lora_name="all8")
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(lora_modules=["a=/x"]).resolve("cpu")
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(enable_lora=True, lora_modules=["just-a-name"])
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    assert_all_blocks_free(llm)
