"""Write a GGUF file's weights again in other GGML types: test and benchmark files of the
types users download (Q5_0 rows beside K-quants, IQ4_NL, ...) made here, never fetched.

`rewrite_gguf(src, dst, choose)` copies every metadata entry and, tensor by tensor, asks
`choose(name, shape, qtype)` for the type to store; the weights are dequantised to fp32
and quantised again. Legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), MXFP4 and BF16/F16/F32 use
the `gguf` package's reference quantisers; IQ4_NL, IQ4_XS and the K-quants (Q2_K to Q6_K) this
module's (`quantize_iq4_nl`, `quantize_iq4_xs`, `quantize_k`: `gguf` 0.19 only dequantises
those), checked against `gguf`'s dequantiser in tests/test_gguf_types.py.

    python -m pagedserve.model.gguf_rewrite SRC.gguf DST.gguf --type q5_0

(the command line rewrites every matrix; 1-D tensors, the norms, keep their type, as
llama-quantize keeps them).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from .gguf_file import GGUFFile

Chooser = Callable[[str, tuple[int, ...], GGMLQuantizationType], GGMLQuantizationType]

# llama.cpp's IQ4_NL code book (ggml-common.h kvalues_iq4nl): a 4-bit index picks one.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_GGUF_QUANTISED = {GGMLQuantizationType[n]
                   for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")}


def _book_scale(blocks: np.ndarray) -> np.ndarray:
    """The scale mapping each block's largest magnitude onto the book's end of the same sign
    (>= 0; llama.cpp then searches nearby scales, one is enough for valid test files)."""
    idx = np.abs(blocks).argmax(-1)[..., None]
    extreme = np.take_along_axis(blocks, idx, -1)[..., 0]
    return np.where(extreme < 0, extreme / -127.0, extreme / 113.0)


def _book_nibbles(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Blocks [..., 32] on per-block scales d -> 16 bytes of nearest-book-value indices each
    (value j low nibble, value j + 16 high)."""
    scaled = blocks / np.where(d == 0, 1.0, d)[..., None]
    codes = np.abs(scaled[..., None] - IQ4_NL_VALUES.astype(np.float32)).argmin(-1).astype(np.uint8)
    return codes[..., :16] | (codes[..., 16:] << 4)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """fp32 [..., K] -> IQ4_NL blocks uint8 [..., K / 32 * 18]: per 32 values an fp16 scale d
    and 16 bytes of code-book indices, each value the nearest d * IQ4_NL_VALUES[i]."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = _book_scale(blocks).astype(np.float16)
    out = np.concatenate([d[..., None].view(np.uint8), _book_nibbles(blocks, d.astype(np.float32))], axis=-1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """fp32 [..., K] (K a multiple of 256) -> IQ4_XS super-blocks uint8 [..., K / 256 * 136]
    (ggml-common.h block_iq4_xs): fp16 d, each block of 32's 6-bit scale s (stored s + 32:
    low nibbles in scales_l, top bits in the 16-bit scales_h) and IQ4_NL's nibbles, value
    d * s * IQ4_NL_VALUES[i]."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 8, 32)
    want = _book_scale(blocks)
    d, d_bytes = _half(want.max(-1) / 31)
    s = np.clip(np.rint(want / np.where(d == 0, 1.0, d)[..., None]), -32, 31).astype(np.int64)
    qs = _book_nibbles(blocks, d[..., None] * s).reshape(*blocks.shape[:-2], 128)
    u = s + 32
    scales_l = ((u[..., 0::2] & 15) | ((u[..., 1::2] & 15) << 4)).astype(np.uint8)
    scales_h = sum(((u[..., i] >> 4) & 3) << (2 * i) for i in range(8)).astype("<u2")
    out = np.concatenate([d_bytes, scales_h[..., None].view(np.uint8), scales_l, qs], axis=-1)
    return out.reshape(*x.shape[:-1], -1)


def _half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 value as fp32, its two bytes)."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h[..., None].view(np.uint8)


def _codes(x: np.ndarray, d: np.ndarray, m: np.ndarray, top: int) -> np.ndarray:
    """round((x + m) / d) in 0..top per value (0 where d is 0), uint8."""
    safe = np.where(d == 0, 1.0, d)
    return np.where(d == 0, 0, np.clip(np.rint((x + m) / safe), 0, top)).astype(np.uint8)


def _crumbs(codes: np.ndarray) -> np.ndarray:
    """Codes 0..3 [..., 256] -> Q2_K / Q3_K's qs [..., 64]: value 128n + 32k + l at bits 2k, 2k + 1
    of byte 32n + l."""
    by_nkl = codes.reshape(*codes.shape[:-1], 2, 4, 32)
    return sum((by_nkl[..., k, :] & 3) << (2 * k) for k in range(4)).astype(np.uint8).reshape(*codes.shape[:-1], 64)


def _quantize_low_k(sb: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Super-blocks fp32 [..., 256] -> Q2_K or Q3_K blocks (ggml-common.h block_q2_K, block_q3_K),
    a scale per 16 values: Q3_K symmetric (w = d s (q - 4), s 6 bits stored + 32, the third
    bit of q in hmask), Q2_K with a min (w = d s q - dmin n, s and n 4 bits)."""
    sub = sb.reshape(*sb.shape[:-1], 16, 16)
    if qtype == GGMLQuantizationType.Q3_K:
        scale = np.abs(sub).max(-1) / 4
        d, d_bytes = _half(scale.max(-1) / 31)
        sc = np.clip(np.rint(scale / np.where(d == 0, 1.0, d)[..., None]), -32, 31).astype(np.int8)
        eff = d[..., None] * sc
        codes = _codes(sub, eff[..., None], 4 * eff[..., None], 7).reshape(sb.shape)  # q + 4
        hmask = sum(((codes[..., 32 * b:32 * b + 32] >> 2) & 1) << b for b in range(8)).astype(np.uint8)
        s6 = (sc.astype(np.int16) + 32).astype(np.uint8)
        scales = np.concatenate([(s6[..., :8] & 15) | ((s6[..., 8:] & 15) << 4),
                                 sum(((s6[..., 4 * q:4 * q + 4] >> 4) & 3) << (2 * q) for q in range(4)).astype(np.uint8)],
                                axis=-1)
        return np.concatenate([hmask, _crumbs(codes), scales, d_bytes], axis=-1)
    low = np.minimum(sub.min(-1), 0)
    scale, lift = (sub.max(-1) - low) / 3, -low
    d, d_bytes = _half(scale.max(-1) / 15)
    dmin, dmin_bytes = _half(lift.max(-1) / 15)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1.0, d)[..., None]), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(lift / np.where(dmin == 0, 1.0, dmin)[..., None]), 0, 15).astype(np.uint8)
    codes = _codes(sub, (d[..., None] * sc)[..., None], (dmin[..., None] * mn)[..., None], 3).reshape(sb.shape)
    return np.concatenate([sc | (mn << 4), _crumbs(codes), d_bytes, dmin_bytes], axis=-1)


def quantize_k(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """fp32 [..., K] (K a multiple of 256) -> Q2_K, Q3_K, Q4_K, Q5_K or Q6_K super-blocks, uint8
    [..., K / 256 * block bytes], in llama.cpp's layout (ggml-common.h block_q4_K ...).

    Each block of 32 (Q2_K, Q3_K, Q6_K: 16) values gets the scale that spans it (and, for
    Q2_K/Q4_K/Q5_K, the min that lifts its lowest value to 0), stored in 4, 6 or 8 bits against
    the super-block's fp16 d (and dmin); codes round to nearest. llama.cpp also searches for
    scales of lower error (make_qkx2_quants); these are valid files of slightly more error."""
    sb = x.astype(np.float32).reshape(*x.shape[:-1], -1, 256)
    if qtype in (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K):
        return _quantize_low_k(sb, qtype).reshape(*x.shape[:-1], -1)
    if qtype == GGMLQuantizationType.Q6_K:
        sub = sb.reshape(*sb.shape[:-1], 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d, d_bytes = _half(scale.max(-1) / 127)
        sc = np.clip(np.rint(scale / np.where(d == 0, 1.0, d)[..., None]), -128, 127).astype(np.int8)
        eff = d[..., None] * sc
        codes = _codes(sub, eff[..., None], 32 * eff[..., None], 63).reshape(*sb.shape)  # q + 32
        by_nkl = codes.reshape(*sb.shape[:-1], 2, 4, 32)  # value 128n + 32k + l
        ql = np.concatenate([(by_nkl[..., 0, :] & 15) | ((by_nkl[..., 2, :] & 15) << 4),
                             (by_nkl[..., 1, :] & 15) | ((by_nkl[..., 3, :] & 15) << 4)], axis=-1)
        qh = sum((by_nkl[..., k, :] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)
        out = np.concatenate([ql.reshape(*sb.shape[:-1], 128), qh.reshape(*sb.shape[:-1], 64),
                              sc.view(np.uint8), d_bytes], axis=-1)
        return out.reshape(*x.shape[:-1], -1)
    if qtype not in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        raise ValueError(f"quantize_k writes Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, not {qtype.name}")
    top = 15 if qtype == GGMLQuantizationType.Q4_K else 31
    sub = sb.reshape(*sb.shape[:-1], 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, lift = (sub.max(-1) - low) / top, -low
    d, d_bytes = _half(scale.max(-1) / 63)
    dmin, dmin_bytes = _half(lift.max(-1) / 63)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1.0, d)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(lift / np.where(dmin == 0, 1.0, dmin)[..., None]), 0, 63).astype(np.uint8)
    codes = _codes(sub, (d[..., None] * sc)[..., None], (dmin[..., None] * mn)[..., None], top)
    # 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4 reads them back).
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)
    qs = ((codes[..., 0::2, :] & 15) | ((codes[..., 1::2, :] & 15) << 4)).reshape(*sb.shape[:-1], 128)
    parts = [d_bytes, dmin_bytes, scales]
    if top == 31:
        parts.append(sum((codes[..., s, :] >> 4) << s for s in range(8)).astype(np.uint8))
    out = np.concatenate([*parts, qs], axis=-1)
    return out.reshape(*x.shape[:-1], -1)


_K_QUANTS = {GGMLQuantizationType[n] for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}


def quantize_as(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """fp32 weights -> the bytes (or values) a GGUF stores for them as `qtype`."""
    if qtype == GGMLQuantizationType.IQ4_NL:
        return quantize_iq4_nl(values)
    if qtype == GGMLQuantizationType.IQ4_XS:
        return quantize_iq4_xs(values)
    if qtype in _K_QUANTS:
        return quantize_k(values, qtype)
    if qtype not in _GGUF_QUANTISED:
        raise ValueError(f"cannot write {qtype.name}: the gguf package quantises only "
                         + ", ".join(sorted(t.name for t in _GGUF_QUANTISED)) + " and this module IQ4_NL, "
                         "IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K")
    return quantize(values, qtype)


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, keep: Callable[[str], bool] = lambda key: True) -> None:
    """Every metadata entry of `reader` whose key `keep` takes, into `writer`."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or not keep(field.name):
            continue  # the writer writes these itself
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), main, sub)


def rewrite_gguf(src: str | Path, dst: str | Path, choose: Chooser) -> dict[str, str]:
    """Copy `src` to `dst` with each tensor stored as choose(name, shape, its type) (shape in
    PyTorch order); returns {tensor name: the type written}."""
    model = GGUFFile(src)
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, model.architecture)
    copy_metadata(reader, writer)
    written = {}
    for t in model.tensors():
        qtype = choose(t.name, t.shape, t.qtype)
        add_tensor_as(writer, t.name, t.to_float32(), qtype)
        written[t.name] = qtype.name
    finish(writer)
    return written


def add_tensor_as(writer: GGUFWriter, name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """fp32 `values` into `writer` as `qtype` (rows must be whole blocks of the type)."""
    block = GGML_QUANT_SIZES[qtype][0]
    if values.shape[-1] % block:
        raise ValueError(f"{name}: rows of {values.shape[-1]} values are not whole {qtype.name} blocks of {block}")
    data = quantize_as(values, qtype)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.model.gguf_rewrite", description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--type", required=True, help="the matrices' type: q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, f16, ...")
    args = parser.parse_args(argv)
    target = GGMLQuantizationType[args.type.upper()]
    written = rewrite_gguf(args.src, args.dst,
                           lambda name, shape, qtype: qtype if len(shape) == 1 else target)
    for name, kind in written.items():
        print(f"{name}: {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
