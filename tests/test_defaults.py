"""What a user gets without flags: a GGUF runs on its own blocks with int8 activations and
an fp16 cache where the native kernels run it (as llama.cpp runs the file), anything else
as --dtype with the model's dtype in the cache; the explicit fp32 path stays the oracle."""
from __future__ import annotations

import json

import pytest

from engine_utils import assert_all_blocks_free, check_busy_batch
from pagedserve import LLM
from pagedserve.engine_config import EngineConfig
from pagedserve.engine.placement import resolve_placement
from pagedserve.kernels import native_unavailable_reason
from pagedserve.model.loader import LoadedModel


def test_the_native_library_is_built():
    # The defaults below resolve through it; a missing build is a failure, never a skip.
    assert native_unavailable_reason() is None


def _resolved(**options) -> tuple[str, str]:
    config = resolve_placement(EngineConfig(device="cpu", **options)).config
    return config.load.quantization, config.kv.kv_cache_dtype


def test_a_gguf_on_the_native_kernels_defaults_to_its_blocks_with_int8_and_fp16_kv():
    assert _resolved() == ("gguf", "fp16")
    assert _resolved(kv_cache_dtype="fp32") == ("gguf", "fp32")
    assert _resolved(quantization="gguf") == ("gguf", "fp16")


def test_everything_else_defaults_to_the_weights_dtype_and_the_models_cache(tmp_path):
    assert _resolved(kernels="torch") == ("none", "auto")
    assert _resolved(quantization="none") == ("none", "auto")
    assert _resolved(tensor_parallel_size=2) == ("none", "auto")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")
    assert _resolved(model=str(folder)) == ("none", "auto")


def test_a_model_loaded_by_the_caller_keeps_what_it_was_loaded_as():
    def loaded(quantization: str) -> LoadedModel:
        return LoadedModel("m", None, None, None, None, quantization)

    for q in ("none", "gguf", "q8_0"):
        config = resolve_placement(EngineConfig(device="cpu"), loaded(q)).config
        assert config.load.quantization == q
        assert config.kv.kv_cache_dtype == ("fp16" if q == "gguf" else "auto")


def test_the_default_engine_runs_int8_blocks_and_an_fp16_cache_and_is_batch_invariant():
    llm = LLM()
    engine = llm.engine
    assert (engine.config.load.quantization, engine.config.kv.kv_cache_dtype) == ("gguf", "fp16")
    assert str(engine.runner.kv_caches[0].dtype) == "torch.float16"
    assert "int8 arithmetic" in engine.loaded.model.describe_weights()
    assert engine.scheduler.step_budget is not None  # the automatic target
    check_busy_batch(llm)
    assert_all_blocks_free(llm)
