"""pagedserve's native CPU kernels, and the choice between them and pure torch.

The op library (`_C.so`, built from csrc/ at install time by setup.py) registers
its ops as `torch.ops.pagedserve.*`. It is compiled for AVX2 + FMA + F16C, so it is
loaded only after the CPU is checked for them: on another CPU, or where the build
did not happen, the pure-torch path runs, which is also the reference every native
op is tested against.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "native", "torch")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
LIBRARY_PATH = Path(__file__).with_name("_C.so")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("unknown CPU" where it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


# The CPU features that decide the native kernels' paths, and AMX, which none takes yet.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


@functools.cache
def native_unavailable_reason() -> str | None:
    """Why the native library cannot run here (None when it is loaded and usable)."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if not LIBRARY_PATH.is_file():
        return f"{LIBRARY_PATH.name} was not built (run `make setup`, or `python setup.py build_ext --inplace`)"
    import torch  # here, so that config (and the torch-free simulator) can name the choices

    try:
        torch.ops.load_library(str(LIBRARY_PATH))
    except (OSError, RuntimeError) as e:
        return f"loading {LIBRARY_PATH} failed: {e}"
    return None


def native_isa() -> str:
    """The widest instruction set the native kernels use here: avx512_vnni (the int8 linear
    layers), avx512 (the fp32 ones) or avx2; PAGEDSERVE_NATIVE_ISA=avx2 holds them to AVX2.
    Every path gives the AVX2 path's bits."""
    reason = native_unavailable_reason()
    if reason is not None:
        raise ValueError(f"the native library cannot run: {reason}")
    import torch

    return torch.ops.pagedserve.native_isa()


@dataclasses.dataclass(frozen=True)
class NativePaths:
    """The native kernels' instruction-set paths as "kernel:isa" names: every one the
    library has, those this CPU can run, and those this process has run so far."""

    all: tuple[str, ...]
    available: tuple[str, ...]
    taken: tuple[str, ...]


def native_paths() -> NativePaths:
    reason = native_unavailable_reason()
    if reason is not None:
        raise ValueError(f"the native library cannot run: {reason}")
    import torch

    ops = torch.ops.pagedserve
    return NativePaths(tuple(ops.isa_paths_all()), tuple(ops.isa_paths_available()), tuple(ops.isa_paths_taken()))


def kernel_report(kernels: str) -> str:
    """What a process runs, for logs and the tensor-parallel ranks' report: "torch", or
    "native (<widest ISA>)"."""
    return f"native ({native_isa()})" if kernels == "native" else kernels


def resolve_kernels(choice: str | None) -> str:
    """"native" or "torch" for a `--kernels` value: auto takes native where it can run;
    asking for native where it cannot is an error that says why."""
    choice = choice or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        return "torch"
    reason = native_unavailable_reason()
    if reason is None:
        return "native"
    if choice == "native":
        raise ValueError(f"kernels='native' but the native library cannot run: {reason}")
    logger.warning("native kernels unavailable (%s); using the pure-torch path", reason)
    return "torch"
