"""benchmarks/gpu_check.py's functions on CPU with tiny configs: what the GPU run will execute,
minus the device (graphs replay eagerly, the "cpu" attention backend stands in for triton)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from engine_utils import KV_BYTES_PER_BLOCK, make_llm
from pagedserve.model.fp8 import Fp8Linear
from pagedserve.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

CPU = torch.device("cpu")


def test_random_models_have_the_configured_shape_and_fp8_layers():
    config = gpu_check.llama_config("tiny")
    bf = gpu_check.random_model(config, CPU, torch.float32)
    fp8 = gpu_check.random_model(config, CPU, torch.float32, "fp8")
    assert sum(p.numel() for p in bf.parameters()) == config.num_params + config.vocab_size * config.hidden_size + \
        config.hidden_size * (2 * config.num_layers + 1)
    assert all(isinstance(m, Fp8Linear) for path, m in fp8.named_linears() if path != "lm_head")
    # Per-step bytes: fp8 stores the decoder's linear weights in 1 byte (+ scales); the head stays.
    head = config.vocab_size * config.hidden_size * 4
    linear = (config.num_params - config.vocab_size * config.hidden_size) * 4
    norms = config.hidden_size * (2 * config.num_layers + 1) * 4
    assert gpu_check.param_bytes(bf) == linear + head + norms
    scales = sum(m.weight_scale.numel() * 4 for p, m in fp8.named_linears() if p != "lm_head")
    assert gpu_check.param_bytes(fp8) == linear // 4 + head + norms + scales
    for name in ("1b", "8b"):
        params = gpu_check.llama_config(name).num_params
        assert {"1b": 1.0e9 < params < 1.6e9, "8b": 7e9 < params < 8.5e9}[name], (name, params)


def test_decode_times_replay_the_eager_logits_and_report_the_roofline():
    model = gpu_check.random_model(gpu_check.llama_config("tiny"), CPU, torch.float32)
    rows = gpu_check.decode_times(model, CPU, (1, 3), context=40, backend="cpu", iters=2, warmup=1)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["graph_vs_eager_max_abs_logit_diff"] < 1e-5  # 3 pads to 4: padding changes nothing
        assert r["eager_ms"] > 0 and r["graph_ms"] > 0 and math.isfinite(r["roofline_fraction_graph"])
        c = model.config
        assert r["kv_bytes"] == r["batch"] * 41 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
        assert r["roofline_ms"] == pytest.approx((r["weight_bytes"] + r["kv_bytes"]) / 4.3e9)


def test_kernel_check_compares_a_backend_with_the_reference():
    # A corner of the GPU run's sweep (the reference backend is slow on CPU): GQA 1 and 3.
    cases = [gpu_check.KERNEL_CASES[0], gpu_check.KERNEL_CASES[-1]]
    seqs = [(1, 1), (1, 17), (7, 40), (33, 33)]
    results = gpu_check.kernel_check(CPU, "cpu", cases, seqs)
    assert len(results) == 3 * len(cases) and {r["kv_dtype"] for r in results} == {"float32", "bfloat16",
                                                                                       "float8_e4m3fn"}
    assert all(r["pass"] for r in results), [r for r in results if not r["pass"]]


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def check_rule(report: dict) -> None:
    assert report["max_abs_logprob_diff_teacher_forced"] > 0 and report["tolerance"] > 0
    for p in report["per_prompt"]:
        # A difference is allowed only at or after the first near-tie of fp32's top two.
        assert p["pass"] == (p["first_difference"] is None
                             or (p["first_near_tie"] is not None and p["first_difference"] >= p["first_near_tie"]))
    assert report["passed"] == sum(p["pass"] for p in report["per_prompt"])


def test_greedy_rule_on_cpu(loaded):
    memory = 128 * KV_BYTES_PER_BLOCK
    texts = gpu_check.REFERENCE_TEXTS[1:3]  # two of the held-in prompts keep the default run short
    reference = make_llm(loaded, kv_cache_memory=memory)
    same = gpu_check.greedy_section(reference, make_llm(loaded, kv_cache_memory=memory), 3, texts)
    assert same["max_abs_logprob_diff_teacher_forced"] == 0 and same["passed"] == same["identical"] == same["prompts"] == 2
    # An fp16 KV cache stands in for the device's rounding (fast on CPU; fp8 weights are slow here).
    fp16 = make_llm(loaded, kv_cache_memory=memory, kv_cache_dtype="fp16")
    check_rule(gpu_check.greedy_section(reference, fp16, 3, texts))


@pytest.mark.slow
def test_greedy_rule_with_fp8_weights_on_cpu(loaded):
    memory = 128 * KV_BYTES_PER_BLOCK
    fp8 = make_llm(load_model(pack=False), quantization="fp8", kv_cache_memory=memory)
    check_rule(gpu_check.greedy_section(make_llm(loaded, kv_cache_memory=memory), fp8, 4))


def test_main_writes_json_per_section(tmp_path):
    results = gpu_check.main([str(tmp_path), "--device", "cpu", "--sections", "decode", "--configs", "tiny",
                              "--batches", "1,2", "--context", "20", "--iters", "1"])
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(written["decode"]) == {"tiny-fp32", "tiny-fp8"} and "error" not in written["decode"]
    assert written["environment"]["device"] == "cpu" and results["decode"]["tiny-fp8"][1]["batch"] == 2
