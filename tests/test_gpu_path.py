"""The GPU path's parts that run without a GPU: device and option checks, the decode-graph
bookkeeping (ladder, buckets, padding, invalidation), padded replays on the real model equal
to eager steps, FP8 weight arithmetic and torch._scaled_mm on CPU, the memory plan shared with
the simulator, and the one-copy device inputs."""
from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from engine_utils import GREEDY, assert_all_blocks_free, busy_batch, make_llm
from pagedserve import SamplingParams
from pagedserve.attention.selector import default_backend_name, get_backend
from pagedserve.attention.testing import random_step
from pagedserve.engine_config import EngineConfig
from pagedserve.core.kv_plan import KVCachePlan, plan_kv_cache
from pagedserve.engine.device_memory import device_memory_plan, kv_dtype_bytes
from pagedserve.engine.placement import resolve_placement
from pagedserve.model.device import resolve_device_name
from pagedserve.model.fp8 import E4M3_MAX, Fp8Linear, fp8_scale, quantize_fp8
from pagedserve.model.loader import load_model
from pagedserve.sim.cost_model import CostModel
from pagedserve.sim.hardware import get_hardware
from pagedserve.sim.memory import plan_memory
from pagedserve.sim.models import MODELS
from pagedserve.worker.cuda_graphs import (
    DecodeGraphRunner,
    StaticDecodeBuffers,
    bucket_for,
    capture_sizes,
    widen,
)
from pagedserve.worker.device_inputs import DeviceInputs
from pagedserve.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


# ------------------------------------------------------------------ device and options


def test_auto_picks_cuda_exactly_when_torch_sees_one(monkeypatch):
    assert resolve_device_name("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device_name("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device_name("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_name("auto") == "cpu"
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device_name("cuda")


@pytest.mark.parametrize("options,match", [
    (dict(device="tpu"), "device must be one of"),
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(device="cuda", quantization="q8_0"), "quantization='q8_0' runs on pagedserve's CPU kernels"),
    (dict(device="cuda", quantization="gguf"), "quantization='gguf'"),
    (dict(device="cuda", kernels="native"), "kernels='native'"),
    (dict(device="cpu", dtype="bfloat16"), "runs on cuda only"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_cudagraph_batch=0), "max_cudagraph_batch"),
])
def test_options_that_cannot_run_are_refused_naming_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options).resolve(options.get("device", "cpu"))


def test_fp8_needs_no_native_kernels_and_cuda_options_parse_from_the_cli():
    assert EngineConfig(quantization="fp8", kernels="torch").quantization == "fp8"
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--device", "cuda", "--dtype", "bfloat16", "--enforce-eager", "--max-cudagraph-batch",
                              "64", "--gpu-memory-utilization", "0.8", "--quantization", "fp8"])
    config = EngineConfig.from_cli_args(args)
    assert (config.device, config.dtype, config.enforce_eager, config.max_cudagraph_batch,
            config.gpu_memory_utilization, config.quantization) == ("cuda", "bfloat16", True, 64, 0.8, "fp8")
    defaults = EngineConfig.from_cli_args(parser.parse_args([]))
    assert (defaults.device, defaults.dtype, defaults.enforce_eager) == ("auto", "auto", False)


def test_cuda_placement_defaults_to_bf16_and_triton_and_refuses_cpu_only_parts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    placement = resolve_placement(EngineConfig(device="auto"))
    assert placement.device.type == "cuda" and placement.config.device.dtype == "bfloat16" and not placement.keeps_loaded_model
    assert default_backend_name("torch", "cuda") == "triton"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on cpu"):
        resolve_placement(EngineConfig(device="cuda", attention_backend="cpu"))
    with pytest.raises(ValueError, match="draft model runs on cpu only"):
        resolve_placement(EngineConfig(device="cuda", speculative_config={"method": "draft_model", "model": "self:2"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = resolve_placement(EngineConfig())
    assert cpu.device.type == "cpu" and cpu.config.device.dtype == "float32" and cpu.keeps_loaded_model
    assert not resolve_placement(EngineConfig(quantization="fp8")).keeps_loaded_model


def test_the_triton_backend_is_named_and_a_missing_one_says_so():
    if importlib.util.find_spec("pagedserve.attention.triton_backend") is None:
        with pytest.raises(ValueError, match="attention backend 'triton' cannot be loaded"):
            get_backend("triton")
    else:
        assert get_backend("triton").name == "triton"


def test_an_engine_asked_for_cuda_without_one_fails_before_loading():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without one")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        make_llm(None, device="cuda")


# ------------------------------------------------------------------ graph bookkeeping


def test_the_capture_ladder_and_bucket_choice():
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert capture_sizes(10) == (1, 2, 4, 8, 10)
    assert capture_sizes(1) == (1,)
    ladder = capture_sizes(1024)
    assert ladder[-1] == 256 and len(ladder) == 3 + 32
    assert capture_sizes(128, max_cudagraph_batch=40)[-3:] == (24, 32, 40)
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]
    assert bucket_for(65, sizes) is None


def test_widening_doubles_up_to_the_model_length():
    assert widen(4, 5, 100) == 8
    assert widen(4, 17, 100) == 32
    assert widen(64, 65, 100) == 100
    with pytest.raises(ValueError, match="max_model_len allows 100"):
        widen(64, 101, 100)


def test_padding_rows_point_at_the_dummy_block_only():
    buffers = StaticDecodeBuffers.allocate(8, 4, dummy_block=9, block_size=16, device=CPU)
    _, _, _, _, meta = random_step([(1, 5), (1, 17), (1, 40)], 4, 2, 8, 16)
    buffers.fill(torch.tensor([7, 8, 9]), meta.seq_lens - 1, meta, padded=4)
    assert buffers.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert buffers.positions[:4].tolist() == [4, 16, 39, 0]
    assert buffers.slot_mapping[:3].tolist() == meta.slot_mapping.tolist()
    assert buffers.slot_mapping[3] == 9 * 16 and buffers.seq_lens[3] == 1
    assert (buffers.block_tables[3:] == 9).all() and buffers.block_tables[:3, :3].tolist() == meta.block_tables.tolist()
    view = buffers.metadata(4, [5, 17, 40, 1])
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4] and view.query_lens_cpu == [1] * 4


def test_steps_that_are_not_plain_decodes_run_eagerly_and_wide_tables_invalidate():
    calls = []

    def forward(ids, positions, meta, rows):
        calls.append((ids.shape[0], meta.block_tables.shape[1]))
        return torch.zeros(ids.shape[0], 3)

    runner = DecodeGraphRunner(forward, capture_sizes(16), max_blocks_per_seq=64, block_size=16, dummy_block=99,
                               device=CPU, mode="eager", initial_width=2)
    runner.capture_all()
    assert runner.stats.captures == len(capture_sizes(16)) and not calls  # eager graphs run nothing at capture
    _, _, _, _, prefill = random_step([(5, 5), (1, 9)], 4, 2, 8, 16)
    assert runner.eager_reason(prefill, 2, False) == "prefill or speculative rows"
    _, _, _, _, decode = random_step([(1, 5), (1, 9), (1, 20)], 4, 2, 8, 16)
    assert runner.eager_reason(decode, 6, False) == "not one sample per row"
    assert runner.eager_reason(decode, 3, True) == "not one sample per row"
    assert runner.eager_reason(decode, 3, False) is None
    big = random_step([(1, 3)] * 17, 4, 2, 8, 16)[4]
    assert runner.eager_reason(big, 17, False) == "batch above the largest captured size"

    assert runner.run(torch.zeros(3, dtype=torch.int64), decode.seq_lens - 1, decode).shape == (3, 3)
    assert calls[-1] == (4, 2) and runner.stats.replays[4] == 1 and runner.stats.invalidations == 0
    long = random_step([(1, 40), (1, 70)], 4, 2, 8, 16)[4]  # 5 blocks: wider than 2
    runner.run(torch.zeros(2, dtype=torch.int64), long.seq_lens - 1, long)
    assert runner.stats.invalidations == 1 and runner.buffers.width == 8 and calls[-1] == (2, 8)
    assert set(runner.graphs) == {2}  # every other graph went with the old buffers


# ------------------------------------------------------------------ padded replay on the real model


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def with_eager_graphs(llm, max_cudagraph_batch=None, width=None):
    """Swap the (unused) runner for one that replays decodes from eager graphs."""
    e, old = llm.engine, llm.engine.runner
    plan = KVCachePlan(old.kv_caches[0].shape[1], old.block_size, 0)
    e.runner = ModelRunner(e.loaded.model, plan, e.config.scheduling.max_num_seqs, e.max_model_len,
                           eos_token_ids=old.eos_token_ids, attention_backend=old.backend.name,
                           decode_graphs="eager", max_cudagraph_batch=max_cudagraph_batch)
    if width is not None:
        e.runner.graphs.invalidate(width)
    return e.runner


def test_padded_graph_replays_give_the_eager_engines_tokens(loaded):
    prompts, params = busy_batch(loaded.tokenizer)
    prompts, params = prompts[:11], params[:11]
    eager = make_llm(loaded, max_num_seqs=16)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    graphed = make_llm(loaded, max_num_seqs=16)
    runner = with_eager_graphs(graphed, width=1)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = runner.graphs.stats
    # Batches of 11 down to 1 as requests finish pad to 16, 8, 4, 2; the tables widened past 1 block.
    assert sum(stats.replays.values()) > 10 and set(stats.replays) <= {1, 2, 4, 8, 16}
    assert stats.replays[16] > 0  # 9 to 11 running rows padded to 16
    assert stats.invalidations >= 2 and stats.eager["prefill or speculative rows"] >= 1
    assert_all_blocks_free(graphed)


def test_padding_writes_only_the_dummy_block(loaded):
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "Hi", "1, 2, 3, 5, 8,")]
    eager = make_llm(loaded, max_num_seqs=8)
    graphed = make_llm(loaded, max_num_seqs=8)
    runner = with_eager_graphs(graphed)
    eager.generate(prompts, GREEDY, use_tqdm=False)
    graphed.generate(prompts, GREEDY, use_tqdm=False)
    assert runner.graphs.stats.replays[4] > 0  # three rows padded to four
    dummy = runner.graphs.dummy_block
    for ours, theirs in zip(runner.kv_caches, eager.engine.runner.kv_caches):
        assert ours.shape[1] == theirs.shape[1] + 1 and ours[:, dummy].abs().sum() > 0  # padding wrote there ...
        assert torch.equal(ours[:, :dummy], theirs)  # ... and the pool holds exactly what eager steps wrote


# ------------------------------------------------------------------ fp8


def test_fp8_scales_map_each_rows_largest_entry_to_448():
    w = torch.randn(6, 64) * torch.tensor([1e-3, 0.1, 1, 10, 300, 0]).unsqueeze(1)
    scale = fp8_scale(w, per_row=True)
    assert scale.shape == (6, 1) and scale[5] == 1.0
    torch.testing.assert_close(scale[:5, 0], w[:5].abs().amax(1) / E4M3_MAX)
    q = quantize_fp8(w, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert (q[:5].float().abs().amax(1) == E4M3_MAX).all() and (q[5].float() == 0).all()
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 for normal values.
    deq = q.float() * scale
    normal = w.abs() >= scale * 2**-6
    assert ((deq - w).abs() <= w.abs() * 2**-4 + 1e-12)[normal].all()
    per_tensor = fp8_scale(w, per_row=False)
    assert per_tensor.dim() == 0 and per_tensor == w.abs().max() / E4M3_MAX


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_linear_through_scaled_mm_on_cpu_equals_the_dequantised_product(granularity):
    gen = torch.Generator().manual_seed(0)
    w, bias, x = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen), torch.randn(5, 64, generator=gen)
    layer = Fp8Linear(w, bias, granularity)
    assert layer.use_scaled_mm  # torch 2.13 runs float8 _scaled_mm on CPU
    x_scale = fp8_scale(x, per_row=granularity == "channel")
    expected = (quantize_fp8(x, x_scale).float() * x_scale) @ layer.dequantized_weight().t() + bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # The quantised layer stays close to the fp32 one (two e4m3 roundings: a few percent).
    assert ((layer(x) - (x @ w.t() + bias)).norm() / (x @ w.t()).norm()) < 0.08
    layer.use_scaled_mm = False  # the weight-only path of devices without FP8 tensor cores
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().t() + bias, rtol=1e-5, atol=1e-5)


# torch's CPU _scaled_mm is a reference kernel (~1 GFLOP/s here): the default run takes one
# prompt and 6 tokens, `make test-slow` two prompts and GREEDY's 24.
@pytest.mark.parametrize("texts,max_tokens,min_agree", [
    (("The capital of France is",), 6, 2),
    pytest.param(("The capital of France is", "def fibonacci(n):"), GREEDY.max_tokens, 4, marks=pytest.mark.slow)],
    ids=["small", "full"])
def test_fp8_engine_on_cpu_mostly_agrees_with_fp32_and_frees_its_blocks(loaded, texts, max_tokens, min_agree):
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    fp32 = make_llm(loaded)
    fp8 = make_llm(load_model(pack=False), quantization="fp8")
    linears = fp8.engine.loaded.model.named_linears()
    assert all(isinstance(m, Fp8Linear) for path, m in linears if path != "lm_head")
    assert not isinstance(linears[-1][1], Fp8Linear)
    ref = [o.outputs[0].token_ids for o in fp32.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    # Greedy tokens before the first difference; the bound is loose, not a measured figure.
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    assert min(agree) >= min_agree, agree
    assert_all_blocks_free(fp8)


# ------------------------------------------------------------------ memory plan


@pytest.mark.parametrize("dtype,quantization,kv,sim_dtype,sim_kv", [
    ("bfloat16", "none", "auto", "bf16", "bf16"),
    ("bfloat16", "fp8", "fp8_e4m3", "fp8", "fp8"),
    ("float32", "none", "fp32", "fp32", "fp32"),
])
@pytest.mark.parametrize("model,hardware", [("llama-3.1-8b", "h200"), ("qwen2.5-7b", "h100-sxm5"),
                                            ("smollm2-135m", "h200")])
def test_the_engines_device_plan_is_the_simulators(dtype, quantization, kv, sim_dtype, sim_kv, model, hardware):
    m, hw = MODELS[model], get_hardware(hardware)
    config = EngineConfig(device="cuda", dtype=dtype, quantization=quantization, kv_cache_dtype=kv,
                          max_num_seqs=128, max_num_batched_tokens=2048, gpu_memory_utilization=0.85)
    ours = device_memory_plan(config.resolve("cuda"), m, hw.memory_bytes, 2048)
    sim = plan_memory(CostModel(m, hw, sim_dtype, sim_kv), 16, 2048, 128, 0.85)
    assert ours == sim
    # The pool the runner allocates from that plan holds the same blocks.
    width = kv_dtype_bytes(kv, dtype)
    assert plan_kv_cache(ours.kv_pool_bytes, 16, m.kv_bytes_per_token(width)).num_blocks == sim.num_blocks


def test_device_plan_names_what_does_not_fit():
    config = EngineConfig(device="cuda", dtype="float32", max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        device_memory_plan(config.resolve("cuda"), MODELS["llama-3.3-70b"], 80 << 30, 2048)


# ------------------------------------------------------------------ device inputs


def test_device_inputs_send_every_tensor_in_one_buffer_and_split_it_back():
    _, _, _, _, meta = random_step([(3, 20), (1, 40), (2, 2)], 4, 2, 8, 16)
    ids, positions, rows = torch.arange(6), torch.arange(10, 16), torch.tensor([2, 3, 5])
    staging = DeviceInputs(CPU, capacity=4)  # grows past its first size
    got_ids, got_pos, got_rows, got_meta = staging.send(ids, positions, rows, meta)
    assert got_ids.tolist() == ids.tolist() and got_pos.tolist() == positions.tolist()
    assert got_rows.tolist() == rows.tolist()
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_tables"):
        assert torch.equal(getattr(got_meta, name), getattr(meta, name)), name
    assert got_meta.seq_lens_cpu == meta.seq_lens_cpu and got_meta.block_size == meta.block_size
