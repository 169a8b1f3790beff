"""One finding per doctor rule, a clean configuration with none, and the CLI's JSON shape."""
import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.sim.doctor import ServeConfig, diagnose, load_matrix

# Llama 3.1 8B BF16 on an H100: ~57 GiB of KV = ~470k tokens; 8k context -> 57 full sequences.
CLEAN = dict(model="llama-3.1-8b", hardware="h100-sxm5", max_model_len=8192, max_num_seqs=32,
             max_num_batched_tokens=512)


def ids(**overrides):
    return {f.id: f for f in diagnose(ServeConfig(**{**CLEAN, **overrides}))}


def test_clean_config_has_no_findings():
    assert ids() == {}


def test_pool_holds_fewer_full_sequences_than_max_num_seqs():
    f = ids(max_num_seqs=256)["kv-pool-vs-max-num-seqs"]
    assert f.severity == "warning" and "max_num_seqs is 256" in f.message
    assert f.change["max_num_seqs"] < 256


def test_max_model_len_beyond_pool_and_empty_pool():
    f = ids(model="llama-3.3-70b", dtype="fp8", max_model_len=None)
    assert f["max-model-len-exceeds-pool"].severity == "error"
    assert "kv-pool-empty" in ids(model="llama-3.3-70b", dtype="bf16")


def test_budget_below_longest_prompt_without_chunking():
    f = ids(enable_chunked_prefill=False)["budget-below-longest-prompt"]
    assert f.severity == "error" and f.change == {"enable_chunked_prefill": True}
    assert "budget-below-longest-prompt" not in ids(enable_chunked_prefill=False, max_num_batched_tokens=8192)


def test_chunk_budget_that_stalls_decodes_uses_the_cost_model():
    f = ids(max_num_batched_tokens=16384)["chunk-stalls-decodes"]
    assert "ms" in f.message and f.change["max_num_batched_tokens"] < 16384


def test_budget_below_max_num_seqs():
    assert ids(max_num_seqs=1024, max_num_batched_tokens=512)["budget-below-max-num-seqs"].severity == "error"


def test_block_size_and_prefix_caching():
    assert ids(block_size=128)["block-size-coarse"].severity == "warning"
    assert ids(block_size=4)["block-size-fine"].severity == "info"
    assert "prefix-caching-off" in ids(enable_prefix_caching=False)


def test_memory_utilization_bounds():
    low = ids(gpu_memory_utilization=0.5)["memory-utilization-low"]
    assert "more KV tokens" in low.message
    assert "memory-utilization-high" in ids(gpu_memory_utilization=0.99)


def test_speculative_matrix():
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    assert ids(speculative_config=spec) == {}
    assert "spec-pipeline-parallel-incompatible" in ids(speculative_config=spec, pipeline_parallel_size=2,
                                                        vllm_version="0.15.0")
    assert "spec-pipeline-parallel-incompatible" not in ids(speculative_config=spec, pipeline_parallel_size=2,
                                                            vllm_version="0.16.0")
    draft = {"model": "llama-3.2-1b", "num_speculative_tokens": 4}
    assert "spec-speculation-incompatible" in ids(speculative_config=draft, vllm_version="0.10.0")
    assert "spec-chunked-prefill-unverified" in ids(speculative_config=spec, vllm_version="0.12.0")
    assert ids(speculative_config={"method": "magic", "num_speculative_tokens": 0}).keys() >= {
        "spec-method-unknown", "spec-num-tokens"}
    assert load_matrix()["latest_known"] == "0.18.0"


def test_cli_json_file_and_simulate(tmp_path, capsys):
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({**CLEAN, "enable_chunked_prefill": False}))
    assert main(["doctor", "--config", str(cfg), "--json", "--simulate", "--num-prompts", "48", "--concurrency", "8",
                 "--long-input-len", "2048", "--long-every", "4"]) == 0
    findings = json.loads(capsys.readouterr().out)
    (f,) = findings
    assert set(f) >= {"id", "severity", "message", "fix"} and f["id"] == "budget-below-longest-prompt"
    before, after = f["impact"]["before"], f["impact"]["after"]
    assert set(before) == set(after) >= {"output_throughput", "p99_itl_ms", "p99_ttft_ms", "num_preemptions"}
    assert before != after  # the fix was simulated (chunked vs whole-prompt steps), not copied
    with pytest.raises(ValueError, match="unknown config keys"):
        ServeConfig.from_mapping({"max_num_sequences": 3})
