"""`pagedserve sim` on a .gguf model prices its weights at the bytes its own types take
(dtype "gguf", the default for a .gguf), not at a float dtype's."""
from __future__ import annotations

import math

import pytest

from pagedserve.model.gguf_file import GGUFFile
from pagedserve.entrypoints.cli import main
from pagedserve.sim.scenario import build_scenario


def test_a_gguf_is_held_and_read_at_its_own_bytes(gguf_path):
    tensors = GGUFFile(gguf_path).tensors()
    file_bytes = sum(t.raw.nbytes for t in tensors)  # SmolLM2: Q4_1 layers, a tied Q8_0 embedding
    own = build_scenario(str(gguf_path), "h100-sxm5", "gguf", kv_cache_memory=2**28)
    bf16 = build_scenario(str(gguf_path), "h100-sxm5", "bf16", kv_cache_memory=2**28)
    assert math.isclose(own.plan.weight_bytes, file_bytes, rel_tol=0.01)
    params = sum(math.prod(t.shape) for t in tensors)
    assert math.isclose(bf16.plan.weight_bytes, 2 * params, rel_tol=0.01)
    # A decode step reads the weights: fewer bytes, less time on memory.
    own_step, bf16_step = own.cost.cost([(1, 256)], 1), bf16.cost.cost([(1, 256)], 1)
    assert own_step.bytes < 0.4 * bf16_step.bytes and own_step.memory_s < 0.4 * bf16_step.memory_s
    assert own.cost.kv_dtype == "bf16"


def test_gguf_dtype_needs_a_gguf_model_and_is_the_default_for_one(gguf_path, capsys):
    with pytest.raises(ValueError, match="model must be a .gguf path"):
        build_scenario("llama-3.1-8b", "h100-sxm5", "gguf")
    assert main(["sim", "--model", str(gguf_path), "--hardware", "h100-sxm5", "--num-prompts", "4", "--json"]) == 0
    assert '"dtype": "gguf"' in capsys.readouterr().out
