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
    native_isa,
    native_paths,
    native_unavailable_reason,
    resolve_kernels,
)
from pagedserve.model.llama import apply_rotary

# Loads the op library for the op tests below; with a broken build they fail (and the
# first test says why) rather than skip.
native_unavailable_reason()


def test_native_library_is_built_and_selected_here():
    """CI's machine has AVX2/FMA/F16C and `make setup` builds the library: a broken
    build must fail here instead of silently running the torch fallback."""
    assert set(REQUIRED_CPU_FLAGS) <= cpu_flags()
    assert LIBRARY_PATH.is_file(), f"{LIBRARY_PATH} missing: the build did not run"
    assert native_unavailable_reason() is None
    assert resolve_kernels("auto") == "native"
    assert resolve_kernels(None) == "native"
    assert resolve_kernels("torch") == "torch"


def test_the_wider_paths_follow_the_cpu(monkeypatch):
    """The AVX-512 and VNNI paths run wherever the CPU has them (a dispatch that never takes
    them would pass every bit-equality test between paths), and PAGEDSERVE_NATIVE_ISA=avx2
    holds every op to AVX2."""
    flags = cpu_flags()
    monkeypatch.delenv("PAGEDSERVE_NATIVE_ISA", raising=False)
    expected = ("avx512_vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags
                else "avx512" if "avx512f" in flags else "avx2")
    assert native_isa() == expected
    monkeypatch.setenv("PAGEDSERVE_NATIVE_ISA", "avx2")
    assert native_isa() == "avx2"
    # Each wider path asks the CPU for every extension its instructions use.
    needs = {"paged_attention:avx512vl": {"avx512f", "avx512vl"}, "dequant_linear:avx512f": {"avx512f"},
             "quant_linear:avx512_vnni": {"avx512f", "avx512bw", "avx512_vnni"},
             "moe_experts_int8:avx512_vnni": {"avx512f", "avx512bw", "avx512_vnni"}}
    paths = native_paths()
    assert set(paths.all) == set(needs) | {"paged_attention:avx2", "dequant_linear:avx2", "quant_linear:avx2",
                                           "moe_experts_int8:avx2"}
    assert set(paths.available) == set(paths.all) - {p for p, n in needs.items() if not n <= flags}


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


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (37, 9, 3, 64), (300, 32, 8, 128), (5, 4, 4, 10)])
def test_rotary_gives_the_torch_paths_bits_in_place_on_qkv_views(tokens, heads, kv_heads, head_dim):
    """q and k are views into the fused qkv output (strided rows), cos/sin views of one
    gathered table row, as the decoder layer passes them; head_dim 10 has a scalar tail."""
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    table = torch.randn(tokens, 1, head_dim, generator=g)
    cos, sin = table[..., : head_dim // 2], table[..., head_dim // 2 :]
    expected_q, expected_k, untouched_v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    torch.ops.pagedserve.rotary_(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, untouched_v)


def test_rotary_rejects_mismatched_shapes():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.pagedserve.rotary_(q, k, torch.randn(4, 1, 3), torch.randn(4, 1, 4))
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.pagedserve.rotary_(q, torch.randn(3, 1, 8), torch.randn(4, 1, 4), torch.randn(4, 1, 4))


