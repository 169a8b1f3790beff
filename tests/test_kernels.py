"""The native op library: built and selected on this machine, and every op equal to
its pure-torch reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import (
    LIBRARY_PATH,
    REQUIRED_CPU_FLAGS,
    cpu_flags,
    native_unavailable_reason,
    resolve_kernels,
)


def test_native_library_is_built_and_selected_here():
    """CI's machine has AVX2/FMA/F16C and `make setup` builds the library: a broken
    build must fail here instead of silently running the torch fallback."""
    assert set(REQUIRED_CPU_FLAGS) <= cpu_flags()
    assert LIBRARY_PATH.is_file(), f"{LIBRARY_PATH} missing: the build did not run"
    assert native_unavailable_reason() is None
    assert resolve_kernels("auto") == "native"
    assert resolve_kernels(None) == "native"
    assert resolve_kernels("torch") == "torch"


def test_unknown_kernel_choice_names_the_parameter():
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("cuda")


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 16, 17, 300])
@pytest.mark.parametrize("dim", [576, 64, 13])
def test_rms_norm_matches_torch(rows, dim):
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    x = torch.randn(rows, dim, generator=g) * 3
    w = torch.randn(dim, generator=g)
    ours = torch.ops.pagedserve.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(ours, F.rms_norm(x, (dim,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_reads_strided_rows_and_keeps_shape():
    """q/k norms see [tokens, heads, head_dim] views of the fused qkv output."""
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    w = torch.randn(64)
    ours = torch.ops.pagedserve.rms_norm(q, w, 1e-6)
    assert ours.shape == q.shape
    torch.testing.assert_close(ours, F.rms_norm(q, (64,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_add_rms_norm_adds_in_place_and_normalises(rows):
    x, residual, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    expected_sum = residual + x
    normed = torch.ops.pagedserve.add_rms_norm_(x, residual, w, 1e-5)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(expected_sum, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_norm_ops_reject_other_dtypes_and_shapes():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedserve.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.pagedserve.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.pagedserve.add_rms_norm_(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
