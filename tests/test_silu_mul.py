"""The native silu(gate) * up op against torch's F.silu(gate) * up.

Bound: the op's exp is a degree-6 polynomial good to ~1 ulp, then one add, one divide and
one multiply in fp32: a few ulps of the result, so 1e-6 relative (8 ulps) plus a tiny
absolute term for results that underflow toward zero.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import resolve_kernels

# Loads the op library; a broken build fails these tests rather than skipping them.
resolve_kernels("native")


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("shape", [(1, 3072), (5, 2 * 1536), (3, 7, 2 * 13), (300, 2 * 40), (2, 2)])
def test_silu_mul_matches_torch(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape) * 6
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -90.0])[: flat.numel()]
    out = torch.ops.pagedserve.silu_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == torch.float32
    ref = reference(x)
    assert ((out.double() - ref).abs() <= 1e-6 * ref.abs() + 1e-30).all()


def test_silu_mul_reads_non_contiguous_input() -> None:
    x = torch.randn(8, 64).t()  # [64, 8]: last dim strided
    torch.testing.assert_close(torch.ops.pagedserve.silu_mul(x).double(), reference(x), rtol=1e-6, atol=0)


def test_silu_mul_rejects_odd_width() -> None:
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.pagedserve.silu_mul(torch.randn(2, 7))
