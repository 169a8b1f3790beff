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
cpu-local's rates are measured, i.e. already achieved, so its efficiencies are 1.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

COMPUTE_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.8
GPU_STEP_OVERHEAD_S = 2e-3
# Latency of one all-reduce call on NVLink (small messages are latency-bound).
ALLREDUCE_LATENCY_S = 10e-6
MIB = 2**20


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


def calibration_path() -> Path:
    root = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    return root / "cpu-local.json"


@dataclass(frozen=True, slots=True)
class Calibration:
    """What `pagedserve sim calibrate` measured on this machine (fp32, as the CPU engine runs)."""

    matmul_flops: float
    mem_bandwidth: float
    step_overhead_s: float
    memory_bytes: int
    num_threads: int

    def hardware(self) -> Hardware:
        return Hardware(CPU_LOCAL, self.memory_bytes, self.mem_bandwidth,
                        {"bf16": self.matmul_flops, "fp8": self.matmul_flops, "fp32": self.matmul_flops},
                        link_bandwidth=self.mem_bandwidth, step_overhead_s=self.step_overhead_s,
                        compute_efficiency=1.0, bandwidth_efficiency=1.0)

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
        return cls(**json.loads(path.read_text()))


def get_hardware(name: str) -> Hardware:
    if name == CPU_LOCAL:
        return Calibration.load().hardware()
    if name not in DATASHEETS:
        raise ValueError(f"hardware must be one of {', '.join(HARDWARE_NAMES)}; got {name!r}")
    return DATASHEETS[name]
