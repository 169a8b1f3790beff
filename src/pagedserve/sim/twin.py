"""`sim calibrate` and `sim twin`: measure this CPU, then compare the real engine with the
simulator on the same small workload. The only module of pagedserve.sim that uses torch
(imported inside the functions, so `import pagedserve.sim...` never loads it)."""
from __future__ import annotations

import statistics
import time

from .hardware import Calibration

TWIN_MODEL = "smollm2-135m"
TWIN_VOCAB = 49_152


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(m: int = 512, k: int = 1024, n: int = 1024) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b), 10)


def measure_bandwidth(num_floats: int = 32 * 2**20) -> float:
    import torch

    src, dst = torch.ones(num_floats), torch.empty(num_floats)
    # A copy reads and writes every byte once.
    return 2 * 4 * num_floats / best_seconds(lambda: dst.copy_(src), 5)


def _engine(policy: str = "chunked"):
    from ..engine.llm import LLM

    return LLM(policy=policy)


def measure_step_overhead(matmul_flops: float, bandwidth: float, batch_sizes: tuple[int, ...] = (1, 8),
                          steps: int = 15) -> float:
    """Real decode steps of SmolLM2 at a couple of batch sizes, minus what the roofline (with no
    overhead) predicts for them: what the engine spends outside the forward's arithmetic."""
    from ..sampling_params import SamplingParams
    from .cost_model import CostModel
    from .models import MODELS

    engine = _engine().engine
    zero = Calibration(matmul_flops, bandwidth, 0.0, 1, 1).hardware()
    cost = CostModel(MODELS[TWIN_MODEL], zero, "fp32")
    excess = []
    for bs in batch_sizes:
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0)
        for i in range(bs):
            engine.add_request([100 + i] * 32, params)
        engine.step()  # the prefill step
        engine.step()
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            measured = time.perf_counter() - t0
            predicted = cost.cost([(1, 34)] * bs, bs).seconds
            excess.append(max(0.0, measured - predicted))
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(excess)


def calibrate() -> tuple[Calibration, object]:
    import torch

    from ..config import default_num_threads

    threads = default_num_threads()
    torch.set_num_threads(threads)
    flops = measure_matmul_flops()
    bandwidth = measure_bandwidth()
    overhead = measure_step_overhead(flops, bandwidth)
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    cal = Calibration(flops, bandwidth, overhead, total, threads)
    return cal, cal.save()


def twin(num_prompts: int = 24, policies: list[str] | None = None, seed: int = 0) -> list[dict]:
    """Each policy through the real engine and through the simulator on cpu-local."""
    from ..bench.datasets import random_dataset
    from ..sampling_params import SamplingParams
    from .cost_model import CostModel
    from .hardware import get_hardware
    from .models import MODELS
    from .simulator import SimConfig, simulate

    policies = policies or ["chunked", "continuous", "static", "naive"]
    # Prompts 32-128 tokens, outputs 16-64 (uniform around 80 and 40).
    requests = random_dataset(num_prompts, 80, 40, 0.6, vocab_size=TWIN_VOCAB, seed=seed)
    cost = CostModel(MODELS[TWIN_MODEL], get_hardware("cpu-local"), "fp32")
    rows = []
    for policy in policies:
        llm = _engine(policy)
        engine = llm.engine
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in requests]
        t0 = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        sched = engine.scheduler
        config = SimConfig(policy=policy, num_blocks=sched.kv_cache.num_blocks, block_size=sched.block_size,
                           max_num_seqs=sched.config.max_num_seqs,
                           max_num_batched_tokens=sched.config.max_num_batched_tokens,
                           max_model_len=sched.config.max_model_len,
                           enable_prefix_caching=sched.cache_config.enable_prefix_caching)
        res = simulate(requests, cost, config)
        sim_tput = res.summary()["output_throughput"]
        rows.append({"policy": policy, "engine_output_throughput": produced / wall,
                     "sim_output_throughput": sim_tput, "ratio": sim_tput / (produced / wall),
                     "engine_duration_s": wall, "sim_duration_s": res.duration})
    return rows
