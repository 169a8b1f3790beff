"""`pagedserve bench compare`: the scheduler study on the real model, offline.

Every policy gets its own LLMEngine over the same loaded weights, so the runs differ
only in scheduling. Requests arrive at time 0 (or at Poisson times for a finite
rate); at most max_concurrency are inside the engine at once and a request's clock
(its send time) starts when it enters, as a client with that many connections would
see it. Each step's scheduler stats are sampled for the KV-waste average and the
timeline plots. The optional Hugging Face baselines run transformers' generate() on
the same GGUF: one request at a time (hf), and static batches of left-padded prompts
in arrival order (hf-static); a streamer timestamps every row's tokens.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.kv_tensor_layout import KVTensorLayout
from ..workload.datasets import BenchRequest
from ..workload.serving_stats import RequestRecord, summarize
from .serve import send_offsets

BASELINES = ("hf", "hf-static")


@dataclass(frozen=True, slots=True)
class StepSample:
    time: float  # seconds since the run started, at the end of the step
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_waste: float
    used_blocks: int


@dataclass(slots=True)
class RunResult:
    name: str
    records: list[RequestRecord]
    duration: float
    steps: list[StepSample] = field(default_factory=list)
    num_preemptions: int = 0
    # KV memory the run held at its peak: the whole zero-filled pool (paged), or the pages
    # the OS committed (contiguous layout).
    peak_kv_committed_bytes: int = 0

    def summary(self) -> dict[str, float]:
        s = summarize(self.records, self.duration)
        s.pop("goodput"), s.pop("goodput_requests")
        if self.steps:
            # Time-weighted over busy steps, as the simulator's, so long prefill steps weigh more.
            prev = [0.0] + [st.time for st in self.steps[:-1]]
            busy = [(st, st.time - p) for st, p in zip(self.steps, prev) if st.kv_usage > 0]
            weight = sum(d for _, d in busy) or 1.0
            s["kv_waste"] = sum(st.kv_waste * d for st, d in busy) / weight
            s["mean_kv_usage"] = sum(st.kv_usage * d for st, d in busy) / weight
            s["peak_blocks_used"] = max(st.used_blocks for st in self.steps)
            s["num_steps"] = len(self.steps)
        else:
            s["kv_waste"] = math.nan
        s["num_preemptions"] = self.num_preemptions
        s["peak_kv_committed_mib"] = self.peak_kv_committed_bytes / 2**20
        return s


def run_engine(loaded, policy: str, requests: Sequence[BenchRequest], *, max_concurrency: int | None = None,
               request_rate: float = math.inf, n: int = 1, seed: int = 0, **engine_options) -> RunResult:
    """The workload through one policy; engine_options go to EngineConfig (kv_cache_memory, ...)."""
    from ..engine_config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..sampling_params import SamplingParams

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
    engine = LLMEngine(EngineConfig(policy=policy, seed=seed, **engine_options), loaded=loaded)
    total_blocks = engine.stats()["kv_total_blocks"]
    offsets = send_offsets(len(requests), request_rate, 1.0, seed)
    order = sorted(range(len(requests)), key=offsets.__getitem__)
    cap = max_concurrency or len(requests)
    records = [RequestRecord(0.0, r.prompt_len, r.output_len, num_output_tokens=0) for r in requests]
    steps: list[StepSample] = []
    nxt = inside = 0
    t0 = time.monotonic()
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while nxt < len(order) and inside < cap and offsets[order[nxt]] <= now:
            i = order[nxt]
            req = requests[i]
            params = SamplingParams(n=n, max_tokens=req.output_len, ignore_eos=True, temperature=0 if n == 1 else 1.0,
                                    seed=None if n == 1 else seed + i)
            # Without a concurrency cap the clock starts at arrival, so queueing counts, as for a client.
            records[i].send_time = now if max_concurrency else offsets[i]
            engine.add_request(req.prompt_token_ids, params, request_id=str(i), arrival_time=t0 + now)
            nxt += 1
            inside += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, offsets[order[nxt]] - (time.monotonic() - t0)))
            continue
        outputs = engine.step()
        t = time.monotonic() - t0
        for delta in outputs:
            rec = records[int(delta.request_id)]
            rec.token_times.extend([t] * sum(len(s.token_ids) for s in delta.samples if s.index == 0))
            rec.num_output_tokens += sum(len(s.token_ids) for s in delta.samples)
            if delta.finished:
                inside -= 1
                rec.num_preemptions = delta.metrics.num_preemptions
        st = engine.stats()
        steps.append(StepSample(t, st["num_running"], st["num_waiting"], st["kv_usage"], st["kv_waste"],
                                total_blocks - st["kv_free_blocks"]))
    duration = time.monotonic() - t0
    peak = engine.scheduler.kv_cache.peak_committed_bytes
    kv_bytes = peak if peak is not None else sum(KVTensorLayout.of(t).nbytes for t in engine.runner.kv_caches)
    return RunResult(policy, records, duration, steps, engine.stats()["num_preemptions"], kv_bytes)


def load_hf_model(model_path):
    """The same GGUF through transformers, float32, for the hf baselines."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    model.eval()
    return model


class _RowClock:
    """A generate() streamer (generate only calls put and end): put() gets the prompt first, then
    one token per row per step; each row's timestamps stop at its own output_len, while the row
    itself keeps decoding until the batch's longest request is done."""

    def __init__(self, records: Sequence[RequestRecord], t0: float):
        self.records, self.t0, self.prompt_seen = records, t0, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.monotonic() - self.t0
        for rec in self.records:
            if len(rec.token_times) < rec.output_len:
                rec.token_times.append(now)

    def end(self) -> None:
        pass


def _generate_batch(model, batch: Sequence[BenchRequest], records: Sequence[RequestRecord], t0: float) -> None:
    """One left-padded greedy generate() over the batch, exactly max(output_len) steps (EOS suppressed)."""
    import torch

    width = max(r.prompt_len for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, req in enumerate(batch):
        ids[row, width - req.prompt_len:] = torch.tensor(req.prompt_token_ids)
        mask[row, width - req.prompt_len:] = 1
    steps = max(r.output_len for r in batch)
    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                   streamer=_RowClock(records, t0), pad_token_id=0)


def _run_hf_batches(model, name: str, requests: Sequence[BenchRequest], batch_cap: int, clock_at_entry: bool,
                    request_rate: float, seed: int) -> RunResult:
    """Batches of up to batch_cap arrived requests in arrival order, each run to completion before
    the next is formed. clock_at_entry: a request's clock starts when its batch starts (a client
    with batch_cap connections), else at its arrival."""
    import torch

    offsets = send_offsets(len(requests), request_rate, 1.0, seed)
    order = sorted(range(len(requests)), key=offsets.__getitem__)
    records = [RequestRecord(offsets[i], r.prompt_len, r.output_len) for i, r in enumerate(requests)]
    nxt = 0
    t0 = time.monotonic()
    with torch.inference_mode():
        while nxt < len(order):
            time.sleep(max(0.0, offsets[order[nxt]] - (time.monotonic() - t0)))
            now = time.monotonic() - t0
            batch = []
            while nxt < len(order) and len(batch) < batch_cap and offsets[order[nxt]] <= now:
                batch.append(order[nxt])
                nxt += 1
            if clock_at_entry:
                for i in batch:
                    records[i].send_time = now
            _generate_batch(model, [requests[i] for i in batch], [records[i] for i in batch], t0)
    return RunResult(name, records, time.monotonic() - t0)


def run_hf(model, requests: Sequence[BenchRequest], request_rate: float = math.inf, seed: int = 0) -> RunResult:
    """transformers generate(), greedy, one request at a time, exactly output_len tokens each;
    clocks start at arrival, like naive's."""
    return _run_hf_batches(model, "hf", requests, 1, False, request_rate, seed)


def run_hf_static(model, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
                  request_rate: float = math.inf, seed: int = 0) -> RunResult:
    """transformers static batching: left-padded generate() over batches of up to max_concurrency
    requests (default: all that have arrived), greedy; a row that has its output_len tokens keeps
    computing until its batch ends, like the `static` policy; clocks as run_engine's."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
    return _run_hf_batches(model, "hf-static", requests, max_concurrency or len(requests),
                           max_concurrency is not None, request_rate, seed)


def ratios(summaries: dict[str, dict], reference: str) -> dict[str, float]:
    """Output throughput of each run over the reference run's."""
    ref = summaries[reference]["output_throughput"]
    return {name: s["output_throughput"] / ref for name, s in summaries.items()}
