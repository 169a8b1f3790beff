"""A roofline per step: max(FLOPs / compute rate, bytes / bandwidth) + all-reduce + overhead.

For a step whose rows compute n_i new tokens after c_i already-computed ones
(T = sum n_i tokens, S rows sampling a token):

    FLOPs  = 2 * P_body * T + 2 * V * H * S                      linear layers (+ LM head on sampling rows)
           + 4 * L * n_heads * d_head * sum_i (n_i * c_i + n_i (n_i + 1) / 2)     causal attention, QK^T and PV
    bytes  = W                                                   every weight, read once per step
           + kv_bytes_per_token * sum_i (c_i + n_i)              context read + new K/V written
           + T * L * (4H + 2q + 2kv + 3I) * act_bytes            each layer's matmul inputs and outputs
    time   = overhead + max(linear/F(w) + attn/F(a), bytes / B) + tp all-reduce

P_body excludes the LM head (V * H); F(w) is the achievable rate for the weight dtype
(FP8 GEMMs on FP8 hardware), F(a) the activation dtype's rate for attention. With
tensor parallelism every term except the overhead is split tp ways and each layer adds
two all-reduces of T * H activations (ring: 2 (tp-1)/tp of the data per GPU).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..core.outputs import SchedulerOutput
from ..model.config import ModelConfig
from .hardware import ALLREDUCE_LATENCY_S, Hardware
from .models import weight_params

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
DTYPES = tuple(DTYPE_BYTES)


def check_dtype(name: str, dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}; got {dtype!r}")


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return self.overhead_s + max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def compute_bound(self) -> bool:
        return self.compute_s >= self.memory_s


class CostModel:
    def __init__(self, model: ModelConfig, hardware: Hardware, weight_dtype: str = "bf16",
                 kv_dtype: str | None = None, tp: int = 1):
        check_dtype("dtype", weight_dtype)
        kv_dtype = kv_dtype or weight_dtype
        check_dtype("kv_cache_dtype", kv_dtype)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"tp must be a positive integer dividing num_kv_heads ({model.num_kv_heads}) or a "
                             f"multiple of it, got {tp!r}")
        self.model, self.hardware, self.tp = model, hardware, tp
        self.weight_dtype, self.kv_dtype = weight_dtype, kv_dtype
        # Activations stay in 16 bits on GPUs even with FP8 weights; the CPU engine runs fp32.
        self.act_dtype = "fp32" if weight_dtype == "fp32" else "bf16"
        m = model
        h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        head = m.vocab_size * h
        self.weight_bytes = weight_params(m) * DTYPE_BYTES[weight_dtype]
        self._read_bytes = (m.num_params) * DTYPE_BYTES[weight_dtype] / tp  # the embedding table is gathered, not read
        self._body_flops_per_token = 2 * (m.num_params - head)
        self._head_flops_per_sample = 2 * head
        self._attn_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim
        # A KV head replicated across tp > num_kv_heads ranks is read by each of them.
        self.kv_bytes_per_token = m.kv_bytes_per_token(DTYPE_BYTES[kv_dtype])
        self._kv_read_per_token = self.kv_bytes_per_token / min(tp, m.num_kv_heads)
        self._act_bytes_per_token = m.num_layers * (4 * h + 2 * q + 2 * kv + 3 * m.intermediate_size) \
            * DTYPE_BYTES[self.act_dtype] / tp
        self._linear_rate = hardware.flops_for(weight_dtype)
        self._attn_rate = hardware.flops_for(self.act_dtype)
        self._bandwidth = hardware.achievable_bandwidth
        self._allreduce_bytes_per_token = (2 * m.num_layers * h * DTYPE_BYTES[self.act_dtype]
                                           * 2 * (tp - 1) / tp) if tp > 1 else 0.0
        self._allreduce_fixed = 2 * m.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0

    def cost(self, rows: Iterable[tuple[int, int]], num_sampled: int) -> StepCost:
        """rows: (num_new_tokens, num_computed_before) per scheduled row."""
        tokens = pairs = context = 0
        for n, c in rows:
            tokens += n
            pairs += n * c + n * (n + 1) // 2
            context += c + n
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        tp = self.tp
        linear = self._body_flops_per_token * tokens + self._head_flops_per_sample * num_sampled
        attn = self._attn_flops_per_pair * pairs
        compute_s = (linear / self._linear_rate + attn / self._attn_rate) / tp
        nbytes = self._read_bytes + self._kv_read_per_token * context + self._act_bytes_per_token * tokens
        comm_s = (self._allreduce_bytes_per_token * tokens / self.hardware.link_bandwidth + self._allreduce_fixed)
        return StepCost(linear + attn, nbytes, compute_s, nbytes / self._bandwidth, comm_s,
                        self.hardware.step_overhead_s)

    def step(self, output: SchedulerOutput) -> StepCost:
        rows = [(r.num_new_tokens, r.start) for r in output.scheduled]
        return self.cost(rows, sum(1 for r in output.scheduled if r.num_samples))

    def step_seconds(self, output: SchedulerOutput) -> float:
        return self.step(output).seconds
