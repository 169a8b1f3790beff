"""Which options go together: every rule lives in EngineConfig.resolve, which refuses each
conflicting set with one ValueError naming the options, before anything is loaded, and no
other module checks it again; the command line is built from the fields' own metadata,
with EngineConfig's defaults."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from pagedserve.engine_config import EngineConfig
from pagedserve.core.scheduler_config import GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS, MIN_WHOLE_PROMPT_BUDGET

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
DRAFT = {"method": "draft_model", "model": "self:2"}
KV_TRANSFER = {"kv_role": "kv_producer"}
INIT = "tcp://127.0.0.1:1"

# (options, the device they resolve on, a caller-loaded model's quantization, the names the error gives)
CONFLICTS = [
    (dict(lora_modules=["a=/x"]), "cpu", None, ("lora_modules", "enable_lora")),
    (dict(enable_lora=True, lora_modules=["a=/x", "b=/y"], max_loras=1), "cpu", None, ("lora_modules", "max_loras")),
    (dict(node_rank=1), "cpu", None, ("node_rank", "nnodes")),
    (dict(tensor_parallel_size=3, nnodes=2, distributed_init_method=INIT), "cpu", None,
     ("tensor_parallel_size", "nnodes")),
    (dict(tensor_parallel_size=2, nnodes=2), "cpu", None, ("nnodes", "distributed_init_method")),
    (dict(tensor_parallel_size=2), "cuda", None, ("tensor_parallel_size", "device")),
    (dict(distributed_executor_backend="ray", tensor_parallel_size=2, nnodes=2, distributed_init_method=INIT),
     "cpu", None, ("distributed_executor_backend", "nnodes")),
    (dict(distributed_executor_backend="ray", tensor_parallel_size=2, distributed_init_method=INIT), "cpu", None,
     ("distributed_executor_backend", "distributed_init_method")),
    (dict(distributed_executor_backend="ray"), "cpu", None, ("distributed_executor_backend", "tensor_parallel_size")),
    (dict(tensor_parallel_size=2), "cpu", "none", ("tensor_parallel_size", "loaded model")),
    (dict(tensor_parallel_size=2, speculative_config=NGRAM), "cpu", None, ("tensor_parallel_size", "speculative_config")),
    (dict(tensor_parallel_size=2, quantization="q8_0"), "cpu", None, ("tensor_parallel_size", "quantization")),
    (dict(tensor_parallel_size=2, quantization="gguf"), "cpu", None, ("tensor_parallel_size", "quantization")),
    (dict(tensor_parallel_size=2, kv_transfer_config=KV_TRANSFER), "cpu", None,
     ("tensor_parallel_size", "kv_transfer_config")),
    (dict(tensor_parallel_size=2, enable_lora=True), "cpu", None, ("tensor_parallel_size", "enable_lora")),
    (dict(attention_backend="contiguous"), "cpu", None, ("attention_backend", "kv_layout")),
    (dict(kv_layout="contiguous", enable_prefix_caching=True), "cpu", None, ("kv_layout", "enable_prefix_caching")),
    (dict(kv_layout="contiguous"), "cuda", None, ("kv_layout", "device")),
    (dict(kv_layout="contiguous", tensor_parallel_size=2), "cpu", None, ("kv_layout", "tensor_parallel_size")),
    (dict(kv_layout="contiguous", kv_transfer_config=KV_TRANSFER), "cpu", None, ("kv_layout", "kv_transfer_config")),
    (dict(kv_layout="contiguous", speculative_config=DRAFT), "cpu", None, ("kv_layout", "speculative_config")),
    *[(dict(kernels="torch", quantization=q), "cpu", None, ("kernels", "quantization"))
      for q in ("q8_0", "q4_0", "q4_1", "gguf")],
    *[(dict(dtype=d), "cpu", None, ("dtype", "device")) for d in ("bfloat16", "float16")],
    *[(dict(quantization=q), "cuda", None, ("quantization", "device")) for q in ("q8_0", "q4_0", "q4_1", "gguf")],
    (dict(kernels="native"), "cuda", None, ("kernels", "device")),
    *[(dict(attention_backend=b), "cuda", None, ("attention_backend", "device")) for b in ("cpu", "native")],
    (dict(speculative_config=DRAFT), "cuda", None, ("speculative_config", "device")),
    (dict(enable_lora=True), "cuda", None, ("enable_lora", "device")),
    *[(dict(itl_target_ms=100, policy=p), "cpu", None, ("itl_target_ms", "policy")) for p in ("continuous", "static", "naive")],
    (dict(ttft_target_ms=500, policy="continuous"), "cpu", None, ("ttft_target_ms", "policy")),
    (dict(itl_target_ms=100, enable_chunked_prefill=False), "cpu", None, ("itl_target_ms", "enable_chunked_prefill")),
    *[(dict(kv_transfer_config=KV_TRANSFER, policy=p), "cpu", None, ("kv_transfer_config", "policy"))
      for p in ("static", "naive")],
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "cpu", None, ("max_num_seqs", "max_num_batched_tokens")),
    (dict(max_num_seqs=4096, itl_target_ms=100), "cpu", None, ("max_num_seqs", "max_num_batched_tokens")),
    (dict(max_num_seqs=4096), "cuda", None, ("max_num_seqs", "max_num_batched_tokens")),
    (dict(device="cpu"), "cuda", None, ("device",)),
    (dict(task="embed", speculative_config=NGRAM), "cpu", None, ("task", "speculative_config")),
    (dict(task="embed", kv_transfer_config=KV_TRANSFER), "cpu", None, ("task", "kv_transfer_config")),
]


@pytest.mark.parametrize("options,device,loaded_as,names", CONFLICTS,
                         ids=[f"{device}-{'-'.join(names)}-{i}" for i, (_, device, _, names) in enumerate(CONFLICTS)])
def test_every_conflict_is_one_error_from_resolve_naming_the_options(options, device, loaded_as, names):
    config = EngineConfig(**options)  # each option is valid on its own
    with pytest.raises(ValueError) as error:
        config.resolve(device, loaded_as)
    for name in names:
        assert name in str(error.value), (name, str(error.value))


def test_the_engine_refuses_a_conflict_before_loading_anything(monkeypatch):
    from pagedserve.engine import llm_engine

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded for a config that cannot run")

    monkeypatch.setattr(llm_engine, "load_model", no_load)
    with pytest.raises(ValueError, match="chunked prefill"):
        llm_engine.LLMEngine(EngineConfig(itl_target_ms=100, policy="continuous", device="cpu"))


def test_a_runner_built_directly_refuses_decode_graphs_beside_a_draft_model():
    from pagedserve.core.kv_plan import KVCachePlan
    from pagedserve.worker.model_runner import ModelRunner

    speculative = EngineConfig(speculative_config=DRAFT).speculative_config
    with pytest.raises(ValueError, match="decode graphs cannot run beside a draft model"):
        ModelRunner(None, KVCachePlan(4, 16, 0, 1), 1, 64, speculative=speculative, decode_graphs="eager")


def test_resolve_fills_what_follows_from_the_other_options_and_is_idempotent():
    cpu = EngineConfig(kernels="torch").resolve("cpu")
    assert (cpu.device.name, cpu.device.kernels, cpu.device.dtype, cpu.load.quantization, cpu.kv.kv_cache_dtype) == (
        "cpu", "torch", "float32", "none", "auto")
    assert cpu.kv.enable_prefix_caching is True and cpu.scheduling.max_num_batched_tokens is None
    assert EngineConfig(kernels="torch", kv_layout="contiguous").resolve("cpu").kv.enable_prefix_caching is False
    cuda = EngineConfig().resolve("cuda")
    assert (cuda.device.name, cuda.device.kernels, cuda.device.dtype, cuda.load.quantization) == (
        "cuda", "torch", "bfloat16", "none")
    assert (cuda.scheduling.max_num_batched_tokens == GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
            and cuda.scheduling.latency_target is None)
    # A target, a fixed budget or a policy that never chunks keeps cuda's budget as given.
    assert EngineConfig(itl_target_ms=50).resolve("cuda").scheduling.max_num_batched_tokens is None
    assert EngineConfig(max_num_batched_tokens=512).resolve("cuda").scheduling.max_num_batched_tokens == 512
    assert EngineConfig(policy="continuous").resolve("cuda").scheduling.max_num_batched_tokens is None
    assert EngineConfig(kernels="torch").resolve("cpu", loaded_as="q8_0").load.quantization == "q8_0"
    for config in (cpu, cuda):
        assert EngineConfig.from_resolved(config).resolve(config.device.name) == config


def test_gguf_weights_auto_keeps_narrow_weights_as_stored_unless_dtype_float32_is_asked_for():
    resolved = [EngineConfig(quantization="none", **o).resolve("cpu").load.gguf_weights
                for o in ({}, dict(dtype="float32"), dict(dtype="float32", gguf_weights="blocks"),
                          dict(gguf_weights="dense"))]
    assert resolved == ["blocks", "dense", "blocks", "dense"]


def test_every_flag_is_typed_by_its_field_and_parses_to_the_defaults():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert all(f.metadata["type"] is not None and f.metadata["help"] for f in dataclasses.fields(EngineConfig))
    assert EngineConfig.from_cli_args(parser.parse_args([])) == EngineConfig()
    actions = {a.dest: a for a in parser._actions}
    assert actions["gpu_memory_utilization"].type is float and actions["itl_target_ms"].type is float
    assert actions["block_size"].type is int and actions["quantization"].choices is not None


# (field, its flag and a value, what the field then holds): every field
ROUND_TRIPS = [
    ("model", ["--model", "m.gguf"], "m.gguf"),
    ("block_size", ["--block-size", "32"], 32),
    ("kv_cache_memory", ["--kv-cache-memory", "2GiB"], 2 << 30),
    ("max_num_seqs", ["--max-num-seqs", "8"], 8),
    ("max_num_batched_tokens", ["--max-num-batched-tokens", "512"], 512),
    ("max_model_len", ["--max-model-len", "1024"], 1024),
    ("enable_prefix_caching", ["--no-enable-prefix-caching"], False),
    ("enable_chunked_prefill", ["--no-enable-chunked-prefill"], False),
    ("long_prefill_token_threshold", ["--long-prefill-token-threshold", "64"], 64),
    ("scheduling_policy", ["--scheduling-policy", "priority"], "priority"),
    ("policy", ["--policy", "static"], "static"),
    ("attention_backend", ["--attention-backend", "reference"], "reference"),
    ("kernels", ["--kernels", "torch"], "torch"),
    ("itl_target_ms", ["--itl-target-ms", "42.5"], 42.5),
    ("ttft_target_ms", ["--ttft-target-ms", "900.5"], 900.5),
    ("quantization", ["--quantization", "q4_0"], "q4_0"),
    ("gguf_weights", ["--gguf-weights", "dense"], "dense"),
    ("kv_cache_dtype", ["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2"),
    ("kv_layout", ["--kv-layout", "contiguous"], "contiguous"),
    ("device", ["--device", "cuda"], "cuda"),
    ("dtype", ["--dtype", "float16"], "float16"),
    ("enforce_eager", ["--enforce-eager"], True),
    ("max_cudagraph_batch", ["--max-cudagraph-batch", "64"], 64),
    ("gpu_memory_utilization", ["--gpu-memory-utilization", "0.5"], 0.5),
    ("num_threads", ["--num-threads", "3"], 3),
    ("seed", ["--seed", "7"], 7),
    ("speculative_config", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config),
    ("tensor_parallel_size", ["--tensor-parallel-size", "2"], 2),
    ("distributed_init_method", ["--distributed-init-method", "env://"], "env://"),
    ("nnodes", ["--nnodes", "2"], 2),
    ("node_rank", ["--node-rank", "1"], 1),
    ("distributed_executor_backend", ["--distributed-executor-backend", "ray"], "ray"),
    ("kv_transfer_config", ["--kv-transfer-config", '{"kv_role": "kv_consumer"}'],
     EngineConfig(kv_transfer_config={"kv_role": "kv_consumer"}).kv_transfer_config),
    ("kv_offload_dir", ["--kv-offload-dir", "/srv/kv"], "/srv/kv"),
    ("kv_offload_size", ["--kv-offload-size", "20GiB"], 20 << 30),
    ("enable_lora", ["--enable-lora"], True),
    ("lora_modules", ["--lora-modules", "a=/x", "b=/y"], {"a": "/x", "b": "/y"}),
    ("max_loras", ["--max-loras", "2"], 2),
    ("max_lora_rank", ["--max-lora-rank", "8"], 8),
    ("task", ["--task", "embed"], "embed"),
    ("pooling_type", ["--pooling-type", "mean"], "mean"),
]


@pytest.mark.parametrize("name,flags,value", ROUND_TRIPS)
def test_every_field_round_trips_through_its_flag(name, flags, value):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(flags))
    assert getattr(config, name) == value and type(getattr(config, name)) is type(value)
    assert dataclasses.replace(config, **{name: getattr(EngineConfig(), name)}) == EngineConfig()


def test_the_round_trip_table_names_every_field():
    assert [name for name, _, _ in ROUND_TRIPS] == [f.name for f in dataclasses.fields(EngineConfig)]


# ------------------------------------------------------------------ one home per rule

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedserve"
RULE_HOMES = {SRC / "engine_config.py", SRC / "core" / "scheduler_config.py"}


def _rule_messages() -> list[str]:
    """The literal text of every ValueError that resolve's rules raise: the longest constant
    piece of each message raised in engine_config.py's EngineConfig.resolve and _check_*/_scheduling
    methods and module-level check_* functions, and in core's check_seats_fit_budget."""
    pieces = []
    for path in RULE_HOMES:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or not (fn.name in ("resolve", "_scheduling")
                                                           or fn.name.startswith(("_check_", "check_"))):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                    parts = [c.value for arg in node.exc.args for c in ast.walk(arg)
                             if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                    pieces.append(max(parts, key=len).strip())
    return pieces


def test_every_rule_message_of_resolve_lives_in_one_place():
    messages = _rule_messages()
    assert len(messages) >= 35 and all(len(m) >= 12 for m in messages), messages
    elsewhere = {p: p.read_text() for p in SRC.rglob("*.py") if p not in RULE_HOMES}
    copies = [(m, str(p.relative_to(SRC))) for m in messages for p, text in elsewhere.items() if m in text]
    assert not copies, f"a rule of resolve is checked again outside it: {copies}"


# A token budget (or a budget-sized default) given as the literal 512, in any of the forms
# the simulator, the Ray app and the scheduler config once wrote it.
BUDGET_512 = re.compile(r"(?i)(max_num_batched_tokens|budget)\w*\W{0,3}(:[^=\n]*)?=\s*512\b|or 512\b"
                        r"|budget \(default 512\)|\"max_num_batched_tokens\": 512")


def test_the_literal_default_budget_is_defined_once():
    defined = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if BUDGET_512.search(p.read_text())]
    assert defined == ["core/scheduler_config.py"], defined


@pytest.mark.parametrize("options,for_worker,names", [
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=1, distributed_init_method=INIT), False, ("node_rank",)),
    (dict(), True, ("nnodes", "node-rank")),
    (dict(max_num_seqs=4096, policy="chunked", max_num_batched_tokens=1024), False,
     ("max_num_seqs", "max_num_batched_tokens")),
])
def test_rules_about_the_nodes_role_and_the_seats_fire_from_resolve(options, for_worker, names):
    with pytest.raises(ValueError) as error:
        EngineConfig(**options).resolve("cpu", for_worker=for_worker)
    for name in names:
        assert name in str(error.value)


def test_the_budget_is_decided_once_by_resolve():
    cpu = EngineConfig(kernels="torch").resolve("cpu").scheduling
    assert (cpu.max_num_batched_tokens, cpu.step_token_cap) == (None, MIN_WHOLE_PROMPT_BUDGET)
    assert cpu.scheduler_config(8192).max_num_batched_tokens == MIN_WHOLE_PROMPT_BUDGET
    fixed = EngineConfig(kernels="torch", max_num_batched_tokens=300).resolve("cpu").scheduling
    assert (fixed.step_token_cap, fixed.latency_target) == (300, None)
    whole = EngineConfig(kernels="torch", policy="continuous").resolve("cpu").scheduling
    assert whole.step_token_cap is None and whole.scheduler_config(8192).max_num_batched_tokens == 8192
