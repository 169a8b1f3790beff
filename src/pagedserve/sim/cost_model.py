"""A roofline per step: max(FLOPs / compute rate, bytes / bandwidth) + all-reduce + overhead.

For a step whose rows compute n_i new tokens after c_i already-computed ones
(T = sum n_i tokens, S rows sampling a token):

    FLOPs  = 2 * P_body * T + 2 * V * H * S                      linear layers (+ LM head on sampling rows)
           + 4 * L * n_heads * d_head * sum_i (n_i * c_i + n_i (n_i + 1) / 2)     causal attention, QK^T and PV
    bytes  = W                                                   every weight, read once per step
           + kv_bytes_per_token * sum_i (c_i + n_i)              context read + new K/V written
           + T * L * (4H + 2q + 2kv + 3I) * act_bytes            each layer's matmul inputs and outputs
    time   = overhead + max(body/F(w) + head/F(h) + attn/F(a), bytes / B) + tp all-reduce

P_body excludes the LM head (V * H); F(w) is the achievable rate for the weight dtype
(FP8 GEMMs on FP8 hardware), F(h) the head's (BF16 with FP8 weights: FP8 checkpoints keep
the LM head and embedding in BF16), F(a) the activation dtype's rate for attention. With
tensor parallelism every term except the overhead is split tp ways and each layer adds
two all-reduces of T * H activations (ring: 2 (tp-1)/tp of the data per GPU).

On cpu-local (hardware with MeasuredRates) a step is priced by the rates `sim calibrate`
measured on the CPU engine's own primitives, and the parts are added, as a CPU runs them
in turn:

    time = overhead + L * attention_call + overhead_per_token * T
         + 2 P_body T / linear_rate(T) + 2 V H S / head_rate(S)        (rates interpolated by rows)
         + prefill attention FLOPs / attention_rate + KV bytes read / kv_bandwidth

with the attention split as the CPU backend splits it (cpu_attention_work).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..core.scheduler_output import SchedulerOutput
from ..core.memory_plan import weight_bytes
from ..core.step_budget import SHORT_QUERY_LEN, StepTimeModel
from ..core.validation import is_int
from ..model.config import ModelConfig
from .hardware import ALLREDUCE_LATENCY_S, Hardware, MeasuredRates, rate_at
from .models import StoredWeights

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
DTYPES = tuple(DTYPE_BYTES)
# The weight "dtype" that prices a .gguf model at its own types' bytes (scenario.build_scenario).
GGUF_DTYPE = "gguf"


def check_dtype(name: str, dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}; got {dtype!r}")


def row_totals(rows: Iterable[tuple[int, int]]) -> tuple[int, int, int]:
    """(tokens, causal (query, key) pairs, context tokens read incl. the new ones) of a step
    whose rows compute n new tokens after c computed ones."""
    tokens = pairs = context = 0
    for n, c in rows:
        tokens += n
        pairs += n * c + n * (n + 1) // 2
        context += c + n
    return tokens, pairs, context


def cpu_attention_work(rows: Iterable[tuple[int, int]], min_prefill_len: int) -> tuple[int, int]:
    """(K/V tokens read from the cache, (query, key) pairs priced as FLOPs) on the CPU backend.
    A short query (a decode) is batched with the others over its gathered context: bound by
    that read, its few FLOPs per key ride along. A prefill chunk is FLOP-bound over its pairs
    and gathers only its earlier context (its own K/V come straight from the step)."""
    kv_tokens = pairs = 0
    for n, c in rows:
        if n < min_prefill_len:
            kv_tokens += c + n
        else:
            kv_tokens += c
            pairs += n * c + n * (n + 1) // 2
    return kv_tokens, pairs


def attention_flops_per_pair(model: ModelConfig) -> int:
    """QK^T and PV: 2 FLOPs each per head dimension, per query head and layer."""
    return 4 * model.num_layers * model.num_heads * model.head_dim


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    # Compute and memory time add up (a CPU's measured rates) instead of overlapping (roofline).
    serial: bool = False

    @property
    def seconds(self) -> float:
        body = self.compute_s + self.memory_s if self.serial else max(self.compute_s, self.memory_s)
        return self.overhead_s + body + self.comm_s

    @property
    def compute_bound(self) -> bool:
        return self.compute_s >= self.memory_s


class CostModel:
    def __init__(self, model: ModelConfig, hardware: Hardware, weight_dtype: str = "bf16",
                 kv_dtype: str | None = None, tp: int = 1, stored: StoredWeights | None = None):
        """`stored`: a GGUF's own bytes per weight, which replace weight_dtype's (its blocks
        are multiplied at weight_dtype's rate)."""
        check_dtype("dtype", weight_dtype)
        kv_dtype = kv_dtype or weight_dtype
        check_dtype("kv_cache_dtype", kv_dtype)
        if not is_int(tp) or tp < 1 or model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"tp must be a positive integer dividing num_kv_heads ({model.num_kv_heads}) or a "
                             f"multiple of it, got {tp!r}")
        if hardware.measured is not None and tp != 1:
            raise ValueError(f"tp must be 1 on {hardware.name} (the CPU engine has no tensor parallelism), got {tp}")
        self.model, self.hardware, self.tp = model, hardware, tp
        self.weight_dtype, self.kv_dtype = weight_dtype, kv_dtype
        # Activations stay in 16 bits on GPUs even with FP8 weights; the CPU engine runs fp32.
        self.act_dtype = "fp32" if weight_dtype == "fp32" else "bf16"
        m = model
        h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        head = m.vocab_size * h
        # FP8 checkpoints quantise the decoder's linear layers only: the LM head is on their
        # ignore list and the embedding is no linear layer, so both stay BF16 (and the head's
        # GEMM runs at the BF16 rate).
        self.head_dtype = "bf16" if weight_dtype == "fp8" else weight_dtype
        self.weight_dtype_bytes = stored.body if stored else DTYPE_BYTES[weight_dtype]
        self.head_dtype_bytes = stored.head if stored else DTYPE_BYTES[self.head_dtype]
        body_bytes = (m.num_params - head) * self.weight_dtype_bytes
        self.weight_bytes = weight_bytes(m, self.weight_dtype_bytes, self.head_dtype_bytes)
        # The embedding table is gathered, not read.
        self._read_bytes = (body_bytes + head * self.head_dtype_bytes) / tp
        self._body_flops_per_token = 2 * (m.num_params - head)
        self._head_flops_per_sample = 2 * head
        self._attn_flops_per_pair = attention_flops_per_pair(m)
        # A KV head replicated across tp > num_kv_heads ranks is read by each of them.
        self.kv_bytes_per_token = m.kv_bytes_per_token(DTYPE_BYTES[kv_dtype])
        self._kv_read_per_token = self.kv_bytes_per_token / min(tp, m.num_kv_heads)
        self._act_bytes_per_token = m.num_layers * (4 * h + 2 * q + 2 * kv + 3 * m.intermediate_size) \
            * DTYPE_BYTES[self.act_dtype] / tp
        self._linear_rate = hardware.flops_for(weight_dtype)
        self._head_rate = hardware.flops_for(self.head_dtype)
        self._attn_rate = hardware.flops_for(self.act_dtype)
        self._bandwidth = hardware.achievable_bandwidth
        self._allreduce_bytes_per_token = (2 * m.num_layers * h * DTYPE_BYTES[self.act_dtype]
                                           * 2 * (tp - 1) / tp) if tp > 1 else 0.0
        self._allreduce_fixed = 2 * m.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0

    def cost(self, rows: Iterable[tuple[int, int]], num_sampled: int) -> StepCost:
        """rows: (num_new_tokens, num_computed_before) per scheduled row."""
        rows = list(rows)
        tokens, pairs, context = row_totals(rows)
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        if self.hardware.measured is not None:
            return self._measured_cost(self.hardware.measured, rows, tokens, num_sampled)
        tp = self.tp
        body = self._body_flops_per_token * tokens
        head = self._head_flops_per_sample * num_sampled
        attn = self._attn_flops_per_pair * pairs
        compute_s = (body / self._linear_rate + head / self._head_rate + attn / self._attn_rate) / tp
        nbytes = self._read_bytes + self._kv_read_per_token * context + self._act_bytes_per_token * tokens
        comm_s = (self._allreduce_bytes_per_token * tokens / self.hardware.link_bandwidth + self._allreduce_fixed)
        return StepCost(body + head + attn, nbytes, compute_s, nbytes / self._bandwidth, comm_s,
                        self.hardware.step_overhead_s)

    def _measured_cost(self, rates: MeasuredRates, rows: list[tuple[int, int]], tokens: int,
                       num_sampled: int) -> StepCost:
        linear = self._body_flops_per_token * tokens
        linear_s = linear / rate_at(rates.linear, tokens)
        head = self._head_flops_per_sample * num_sampled
        if num_sampled:
            linear_s += head / rate_at(rates.head, num_sampled)
        kv_tokens, pairs = cpu_attention_work(rows, rates.min_prefill_len)
        attn = self._attn_flops_per_pair * pairs
        kv_bytes = self.kv_bytes_per_token * kv_tokens
        overhead = (self.hardware.step_overhead_s + self.model.num_layers * rates.attention_call_s
                    + rates.overhead_per_token_s * tokens)
        return StepCost(linear + head + attn, kv_bytes, linear_s + attn / rates.attention_flops,
                        kv_bytes / rates.kv_bandwidth, 0.0, overhead, serial=True)

    def step(self, output: SchedulerOutput) -> StepCost:
        rows = [(r.num_new_tokens, r.start) for r in output.scheduled]
        return self.cost(rows, sum(1 for r in output.scheduled if r.num_samples))

    def step_seconds(self, output: SchedulerOutput) -> float:
        return self.step(output).seconds

    def step_time_model(self, max_tokens: int = 256) -> StepTimeModel:
        """This cost model as the affine StepTimeModel a latency target budgets with: each
        coefficient from the difference of two priced steps. The per-token cost is the secant
        between 16 and `max_tokens` tokens, the range a budgeted step spans (a decode batch
        plus a chunk); a 1-row step is then over-predicted, which only makes it cautious."""
        def t(rows: list[tuple[int, int]], samples: int = 0) -> float:
            return self.cost(rows, samples).seconds

        one = t([(1, 0)])
        low = SHORT_QUERY_LEN
        per_token = max((t([(1, 0)] * max_tokens) - t([(1, 0)] * low)) / (max_tokens - low), 1e-12)
        per_sample = max((t([(1, 0)], 64) - one) / 64, 0.0)
        ctx = 4096
        per_context = max((t([(1, ctx)]) - one) / ctx, 0.0)
        chunk = max(max_tokens, SHORT_QUERY_LEN)
        per_pair = max((t([(chunk, ctx)]) - t([(chunk, 0)])) / (chunk * ctx), 0.0)
        fixed = max(t([(1, 0)] * low) - low * per_token, 0.0)
        return StepTimeModel(fixed, per_token, per_sample, per_context, per_pair)
