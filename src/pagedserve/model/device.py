"""Where the model runs and in which dtype: `--device` and `--dtype` resolved (which other
options each allows is EngineConfig.resolve's).

Importing this module does not import torch (the config and the simulator name the choices);
`resolve_device` and `torch_dtype` do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
# The compute dtypes, each named as torch names it, with its bytes per weight / activation
# element: the one list of them (--dtype's choices are these and "auto").
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)
# What --quantization may be on CUDA: the block formats run on pagedserve's AVX2 kernels only.
CUDA_QUANTIZATION = ("auto", "none", "fp8")


def resolve_device_name(choice: str) -> str:
    """"cpu" or "cuda" for a --device value; auto picks cuda when torch sees one."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device "
                         f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    return choice


def resolve_dtype_name(dtype: str, device: str) -> str:
    """The compute dtype for a resolved device: auto is float32 on cpu, bfloat16 on cuda."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return dtype


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a resolved dtype name (KeyError for any other)."""
    import torch

    if name not in DTYPE_BYTES:
        raise KeyError(name)
    return getattr(torch, name)
