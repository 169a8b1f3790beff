"""Write a GGUF file's weights again in other GGML types: test and benchmark files of the
types users download (Q5_0 rows beside K-quants, IQ4_NL, ...) made here, never fetched.

`rewrite_gguf(src, dst, choose)` copies every metadata entry and, tensor by tensor, asks
`choose(name, shape, qtype)` for the type to store; the weights are dequantised to fp32
and quantised again. Legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and BF16/F16/F32 use the
`gguf` package's reference quantisers, IQ4_NL this module's (`quantize_iq4_nl`, checked
against `gguf`'s dequantiser in tests/test_gguf_types.py).

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
_GGUF_QUANTISED = {GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """fp32 [..., K] -> IQ4_NL blocks uint8 [..., K / 32 * 18]: per 32 values an fp16 scale d
    and 16 bytes of code-book indices (value j low nibble, value j + 16 high), each value
    the nearest d * IQ4_NL_VALUES[i]. The scale maps the block's largest magnitude onto the
    book's end of the same sign (llama.cpp then searches nearby scales; one is enough for
    valid test files)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    idx = np.abs(blocks).argmax(-1)[..., None]
    extreme = np.take_along_axis(blocks, idx, -1)[..., 0]
    d = np.where(extreme < 0, extreme / -127.0, extreme / 113.0).astype(np.float16)
    scaled = blocks / np.where(d == 0, 1.0, d.astype(np.float32))[..., None]
    codes = np.abs(scaled[..., None] - IQ4_NL_VALUES.astype(np.float32)).argmin(-1).astype(np.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([d[..., None].view(np.uint8), packed], axis=-1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_as(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """fp32 weights -> the bytes (or values) a GGUF stores for them as `qtype`."""
    if qtype == GGMLQuantizationType.IQ4_NL:
        return quantize_iq4_nl(values)
    if qtype not in _GGUF_QUANTISED:
        raise ValueError(f"cannot write {qtype.name}: the gguf package quantises only "
                         + ", ".join(sorted(t.name for t in _GGUF_QUANTISED)) + " and this module IQ4_NL")
    return quantize(values, qtype)


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
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
    _copy_metadata(reader, writer)
    written = {}
    for t in model.tensors():
        qtype = choose(t.name, t.shape, t.qtype)
        block = GGML_QUANT_SIZES[qtype][0]
        if t.shape[-1] % block:
            raise ValueError(f"{t.name}: rows of {t.shape[-1]} values are not whole {qtype.name} blocks of {block}")
        data = quantize_as(t.to_float32(), qtype)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
        written[t.name] = qtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


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
