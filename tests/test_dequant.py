"""Dequantisation of each supported GGUF type, checked on blocks packed by hand from
the ggml block layouts: known integers and scales in, exact floats out."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pagedserve.model.gguf_file import GGUFTensor

rng = np.random.default_rng(0)


def f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def dequant(qtype: T, raw: bytes, n: int) -> np.ndarray:
    t = GGUFTensor("t", qtype, (1, n), np.frombuffer(raw, dtype=np.uint8).reshape(1, -1))
    return t.to_float32()[0]


def nibbles(lo: np.ndarray, hi: np.ndarray) -> bytes:
    return bytes(int(a) | (int(b) << 4) for a, b in zip(lo, hi))


def test_f32_f16_bf16():
    x = np.array([1.5, -2.25, 0.0, 3072.0], dtype=np.float32)
    np.testing.assert_array_equal(
        GGUFTensor("t", T.F32, (4,), x.copy()).to_float32(), x
    )
    np.testing.assert_array_equal(
        GGUFTensor("t", T.F16, (4,), x.astype(np.float16)).to_float32(), x
    )
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bf16
    np.testing.assert_array_equal(
        GGUFTensor("t", T.BF16, (4,), bf16.view(np.uint8).reshape(1, -1)).to_float32().reshape(4), x
    )


def test_q8_0():
    q = rng.integers(-128, 128, 32)
    raw = f16(0.25) + q.astype(np.int8).tobytes()
    np.testing.assert_array_equal(dequant(T.Q8_0, raw, 32), 0.25 * q)


def test_q4_0_and_q4_1():
    q = rng.integers(0, 16, 32)  # element j in the low nibble of byte j, j+16 in the high one
    packed = nibbles(q[:16], q[16:])
    np.testing.assert_array_equal(dequant(T.Q4_0, f16(0.5) + packed, 32), 0.5 * (q - 8))
    np.testing.assert_array_equal(dequant(T.Q4_1, f16(0.5) + f16(-1.0) + packed, 32), 0.5 * q - 1.0)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> bytes:
    """Eight 6-bit (scale, min) pairs in 12 bytes, as ggml's get_scale_min_k4 reads them."""
    b = [0] * 12
    for j in range(4):
        b[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        b[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        b[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    return bytes(b)


def test_q4_k():
    d, dmin = 0.125, 0.5
    sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 16, 256)
    qs = b"".join(nibbles(q[64 * j : 64 * j + 32], q[64 * j + 32 : 64 * j + 64]) for j in range(4))
    raw = f16(d) + f16(dmin) + pack_k_scales(sc, mn) + qs
    sub = np.arange(256) // 32
    np.testing.assert_allclose(dequant(T.Q4_K, raw, 256), d * sc[sub] * q - dmin * mn[sub], rtol=1e-6)


def test_q5_k():
    d, dmin = 0.0625, 0.25
    sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 32, 256)
    lo, hi = q & 15, q >> 4
    qs = b"".join(nibbles(lo[64 * j : 64 * j + 32], lo[64 * j + 32 : 64 * j + 64]) for j in range(4))
    # Bit 2j of qh[l] is the fifth bit of element 64j+l; bit 2j+1 that of element 64j+32+l.
    qh = bytes(
        sum(int(hi[64 * j + l]) << (2 * j) | int(hi[64 * j + 32 + l]) << (2 * j + 1) for j in range(4))
        for l in range(32)
    )
    raw = f16(d) + f16(dmin) + pack_k_scales(sc, mn) + qh + qs
    sub = np.arange(256) // 32
    np.testing.assert_allclose(dequant(T.Q5_K, raw, 256), d * sc[sub] * q - dmin * mn[sub], rtol=1e-6)


def test_q6_k():
    d = 0.03125
    scales = rng.integers(-128, 128, 16)
    q = rng.integers(0, 64, 256)  # stored unsigned; the value is q - 32
    ql, qh = bytearray(128), bytearray(64)
    for half in range(2):
        base = 128 * half
        for l in range(32):
            q1, q2, q3, q4 = (q[base + l + 32 * k] for k in range(4))
            ql[64 * half + l] = (q1 & 15) | ((q3 & 15) << 4)
            ql[64 * half + l + 32] = (q2 & 15) | ((q4 & 15) << 4)
            qh[32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    raw = bytes(ql) + bytes(qh) + scales.astype(np.int8).tobytes() + f16(d)
    sub = np.arange(256) // 16
    np.testing.assert_allclose(dequant(T.Q6_K, raw, 256), d * scales[sub] * (q - 32), rtol=1e-6)


def test_unsupported_type_names_the_tensor():
    t = GGUFTensor("blk.0.attn_q.weight", T.IQ2_XXS, (1, 256), np.zeros((1, 66), dtype=np.uint8))
    with pytest.raises(ValueError, match="blk.0.attn_q.weight.*IQ2_XXS"):
        t.to_float32()
