"""Accelerators as named datasheet constants, plus `cpu-local` measured by `pagedserve sim calibrate`.

All rates are dense (no 2:4 sparsity) peak figures from the vendor datasheets:
- H100 SXM5 80GB: 3.35 TB/s HBM3; 989 TFLOPS BF16, 1,979 TFLOPS FP8; NVLink 900 GB/s (both directions).
- H200 SXM 141GB: 4.8 TB/s HBM3e; compute as the H100 SXM5; NVLink 900 GB/s.
- A100 SXM 80GB: 2.039 TB/s HBM2e; 312 TFLOPS BF16; no FP8 tensor cores, so FP8 weights are
  dequantised and multiplied at the BF16 rate (weight-only FP8); NVLink 600 GB/s.
- L40S 48GB: 864 GB/s GDDR6; 362 TFLOPS BF16, 733 TFLOPS FP8; PCIe Gen4 x16, 64 GB/s.
Usable memory is what nvidia-smi reports (MiB), not the marketing "GB".

The two efficiency factors are the only non-datasheet numbers (see docs/simulator.md):
large GEMMs reach ~60-75% of dense peak and a whole forward (attention, norms, GEMMs
of awkward shapes) somewhat less, so COMPUTE_EFFICIENCY = 0.6; a streaming read reaches
~90% of HBM peak and decode GEMV/attention kernels ~75-85%, so BANDWIDTH_EFFICIENCY = 0.8.
GPU_STEP_OVERHEAD_S covers what a step costs besides the forward: scheduling, input
preparation, sampling and launching a captured graph, a few ms in vLLM-like engines.

cpu-local has no datasheet: `sim calibrate` measures the CPU engine's own primitives
(MeasuredRates) and the cost model prices a step from those instead of a roofline.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..paths import calibration_path

COMPUTE_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.8
GPU_STEP_OVERHEAD_S = 2e-3
# Latency of one all-reduce call on NVLink (small messages are latency-bound).
ALLREDUCE_LATENCY_S = 10e-6
MIB = 2**20


Ladder = tuple[tuple[int, float], ...]  # (rows, achieved FLOP/s), rows ascending


def rate_at(ladder: Ladder, rows: int) -> float:
    """Achieved FLOP/s of a GEMM with `rows` rows, from rates measured at a ladder of row counts.

    A GEMM's time is close to affine in its rows (a fixed read of the weights plus work per
    row), so time, not rate, is interpolated linearly between the two neighbouring rungs;
    outside the ladder the end rung's rate holds.
    """
    if rows <= ladder[0][0]:
        return ladder[0][1]
    for (m0, r0), (m1, r1) in zip(ladder, ladder[1:]):
        if rows <= m1:
            # Seconds per FLOP-per-row at each rung.
            t0, t1 = m0 / r0, m1 / r1
            return rows / (t0 + (t1 - t0) * (rows - m0) / (m1 - m0))
    return ladder[-1][1]


@dataclass(frozen=True, slots=True)
class MeasuredRates:
    """The CPU engine's primitives as `sim calibrate` measured them, at the twin model's shapes.

    A CPU runs one op after another on the same cores and every rate below already includes
    its own memory traffic, so the cost model adds these times rather than taking a roofline max.
    """

    linear: Ladder  # the decoder layers' linear layers (qkv, o, gate_up, down), by step tokens
    head: Ladder  # the LM head, by sampled rows
    attention_flops: float  # FLOP/s of prefill attention (QK^T and PV over each (query, key) pair)
    kv_bandwidth: float  # bytes/s of K/V gathered from blocks (and attended, for short queries)
    attention_call_s: float  # fixed cost of the attention backend per layer per step
    overhead_per_token_s: float  # norms, RoPE, activations, residual adds per step token
    # The backend's split: a row with fewer new tokens is a short query (decode-like), batched
    # with the others and bound by reading its context; from this many on, a prefill chunk.
    min_prefill_len: int

    def __post_init__(self) -> None:
        for name in ("linear", "head"):
            ladder = getattr(self, name)
            if not ladder or any(m1 <= m0 for (m0, _), (m1, _) in zip(ladder, ladder[1:])):
                raise ValueError(f"{name} must list (rows, FLOP/s) with rows strictly ascending, got {ladder!r}")


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    memory_bytes: int
    mem_bandwidth: float  # bytes/s, peak
    flops: dict[str, float]  # dense FLOP/s by compute dtype: bf16, fp8, fp32
    link_bandwidth: float  # bytes/s one direction between tensor-parallel peers
    step_overhead_s: float
    compute_efficiency: float = COMPUTE_EFFICIENCY
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    measured: MeasuredRates | None = None  # cpu-local only: replaces the roofline
    # Measured step time / the mean of its run, one entry per timed step (cpu-local only):
    # the simulator draws each step's factor from it. Empty: every step takes its price.
    step_spread: tuple[float, ...] = ()

    def flops_for(self, dtype: str) -> float:
        """Achievable FLOP/s for matmuls whose inputs are `dtype`."""
        rate = self.flops.get(dtype) or self.flops["bf16"]
        return rate * self.compute_efficiency

    @property
    def achievable_bandwidth(self) -> float:
        return self.mem_bandwidth * self.bandwidth_efficiency


def _gpu(name: str, mib: int, tbps: float, bf16_tflops: float, fp8_tflops: float | None,
         fp32_tflops: float, link_gbps: float) -> Hardware:
    flops = {"bf16": bf16_tflops * 1e12, "fp32": fp32_tflops * 1e12}
    if fp8_tflops is not None:
        flops["fp8"] = fp8_tflops * 1e12
    return Hardware(name, mib * MIB, tbps * 1e12, flops, link_gbps * 1e9, GPU_STEP_OVERHEAD_S)


DATASHEETS: dict[str, Hardware] = {
    "h100-sxm5": _gpu("h100-sxm5", 81_559, 3.35, 989, 1979, 67, 450),
    "h200": _gpu("h200", 143_771, 4.8, 989, 1979, 67, 450),
    "a100-80gb": _gpu("a100-80gb", 81_920, 2.039, 312, None, 19.5, 300),
    "l40s": _gpu("l40s", 46_068, 0.864, 362, 733, 91.6, 32),
}
CPU_LOCAL = "cpu-local"
HARDWARE_NAMES = (*DATASHEETS, CPU_LOCAL)


@dataclass(frozen=True, slots=True)
class Calibration:
    """What `pagedserve sim calibrate` measured on this machine (fp32, as the CPU engine runs)."""

    rates: MeasuredRates
    matmul_flops: float  # a large square GEMM, the machine's peak: for reference, not priced
    step_overhead_s: float  # scheduling, input preparation, sampling, detokenising
    memory_bytes: int
    num_threads: int
    model: str  # whose shapes the rates were measured at
    # The StepTimeModel a latency target budgets with, fitted from these rates, tagged
    # with the model shape it holds for (engine/step_timing.py reads it back).
    step_time_model: dict | None = None
    # Identical decode steps timed back to back, each over their mean (Hardware.step_spread).
    step_spread: tuple[float, ...] = ()

    def hardware(self) -> Hardware:
        return Hardware(CPU_LOCAL, self.memory_bytes, self.rates.kv_bandwidth,
                        {"bf16": self.matmul_flops, "fp8": self.matmul_flops, "fp32": self.matmul_flops},
                        link_bandwidth=self.rates.kv_bandwidth, step_overhead_s=self.step_overhead_s,
                        compute_efficiency=1.0, bandwidth_efficiency=1.0, measured=self.rates,
                        step_spread=tuple(self.step_spread))

    def save(self, path: Path | None = None) -> Path:
        path = path or calibration_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | None = None) -> "Calibration":
        path = path or calibration_path()
        if not path.exists():
            raise ValueError(f"hardware cpu-local needs a calibration; run `pagedserve sim calibrate` (writes {path})")
        data = json.loads(path.read_text())
        try:
            rates = data.pop("rates")
            rates = MeasuredRates(**{k: tuple(map(tuple, v)) if k in ("linear", "head") else v
                                     for k, v in rates.items()})
            spread = tuple(data.pop("step_spread", ()))
            return cls(rates=rates, step_spread=spread, **data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path} is from an older `pagedserve sim calibrate` ({e}); run it again") from e


def get_hardware(name: str) -> Hardware:
    if name == CPU_LOCAL:
        return Calibration.load().hardware()
    if name not in DATASHEETS:
        raise ValueError(f"hardware must be one of {', '.join(HARDWARE_NAMES)}; got {name!r}")
    return DATASHEETS[name]
