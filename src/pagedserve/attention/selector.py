"""Attention backends by name."""
from __future__ import annotations

from .backend import AttentionBackend, ReferenceBackend
from .backend_names import TRITON_BACKEND
from .contiguous_backend import ContiguousAttention, NativeContiguousAttention
from .cpu_backend import CpuPagedAttention
from .native_backend import NativePagedAttention
from .triton_backend import TritonPagedAttention

_BACKENDS: dict[str, type] = {
    CpuPagedAttention.name: CpuPagedAttention,
    NativePagedAttention.name: NativePagedAttention,
    ReferenceBackend.name: ReferenceBackend,
    TritonPagedAttention.name: TritonPagedAttention,
    ContiguousAttention.name: ContiguousAttention,
    NativeContiguousAttention.name: NativeContiguousAttention,
}
DEFAULT_BACKEND = CpuPagedAttention.name
# The GPU backend (TRITON_BACKEND, TritonPagedAttention). Its module imports without
# triton; building one without it is a ValueError that says why.


def default_backend_name(kernels: str, device: str = "cpu", kv_layout: str = "paged") -> str:
    """The backend for a resolved kernel path ("native" or "torch"), device and KV layout:
    on cuda the Triton kernels; on cpu the native ones need pagedserve's op library, which
    "native" means is loaded."""
    if device != "cpu":
        return TRITON_BACKEND
    if kv_layout == "contiguous":
        return NativeContiguousAttention.name if kernels == "native" else ContiguousAttention.name
    return NativePagedAttention.name if kernels == "native" else DEFAULT_BACKEND


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str | None = None) -> AttentionBackend:
    """A new backend instance; `None` picks the pure-torch default (the fast CPU one)."""
    key = DEFAULT_BACKEND if name is None else name
    if key not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {backend_names()}, got {name!r}")
    return _BACKENDS[key]()
