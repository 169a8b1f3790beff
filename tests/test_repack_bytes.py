"""quant_repack's packed bytes, pinned: the tiles are a contract with every linear kernel
(quant_linear.h's PackedLayout), so a faster packer must write the same bytes, not merely
bytes the value tests accept (those read the codes and scales back; padding, the zero
columns of a partial tile and the unused bits would go unchecked).

The digests are those of the per-column scalar packer (commit 718159b; e03fcc7 for Q2_K,
Q3_K, IQ4_NL and IQ4_XS) on every packable type, over pseudo-random bytes (every code, scale and sign bit pattern, not only what a
quantiser writes), with a partial last tile and enough tiles for the packer's threads to
split them.
"""
from __future__ import annotations

import hashlib

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from pagedserve.kernels import resolve_kernels

resolve_kernels("native")  # loads the op library; a broken build fails here rather than skipping

ROWS = 8 * 40 + 3  # 41 tiles of 8 rows, the last holding 3
DIGESTS = {
    T.F16: "d977b1adebe94e96705f12647f7f7c5d",
    T.Q4_0: "d32c878b3824f784cc6b26a85ff87e7b",
    T.Q4_1: "9bbc7c907901255444d0eb997cf03577",
    T.Q5_0: "066a253e7961c39eaf82bcc78110c44e",
    T.Q5_1: "4b7ecdc256dbeb9a00846bd3b4de681a",
    T.Q8_0: "f330ea8799881f1e0d609c9230b57e2d",
    T.Q4_K: "fc91c41a083c6791b4cd20a3a9ec7c4d",
    T.Q5_K: "111482505806309179b3ce18efe854ed",
    T.Q6_K: "0c3a458cc6cfd478e445b3048ddefe75",
    T.Q2_K: "ecc173659ef6c06a477af07c871d4b6a",
    T.Q3_K: "e53e09ce37026e20d195732b2a551b34",
    T.IQ4_NL: "a31113e1fb5251e95b84e3206fdbcd8c",
    T.IQ4_XS: "57419689626dc35620685ee93a5d3faa",
    T.BF16: "3b70678943538dd34ce1ef0f951c311f",
}


def pseudo_random_blocks(qtype: T, rows: int = ROWS) -> torch.Tensor:
    """rows x 512 values of `qtype` as arbitrary bytes; Q4_0 / Q5_0 scales kept below 2, since
    the packer stores -8d / -16d in fp16 and refuses a block whose offset overflows it."""
    values, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = 512 // values * block_bytes
    raw = bytearray(hashlib.shake_256(qtype.name.encode()).digest(rows * row_bytes))
    if qtype in (T.Q4_0, T.Q5_0):
        for block in range(0, len(raw), block_bytes):
            raw[block + 1] &= 0xBF  # the fp16 scale's top exponent bit
    return torch.frombuffer(raw, dtype=torch.uint8).reshape(rows, row_bytes).clone()


def packed_digest(qtype: T) -> str:
    packed = torch.ops.pagedserve.quant_repack([pseudo_random_blocks(qtype)], int(qtype))
    return hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:32]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("qtype", list(DIGESTS), ids=lambda t: t.name)
def test_packed_bytes_are_the_scalar_packers(qtype: T, threads) -> None:
    assert packed_digest(qtype) == DIGESTS[qtype]


def test_parts_pack_as_their_rows_stacked() -> None:
    """A fused matrix's parts (q, k, v) pack straight into one output, whatever their row
    counts (a part may end inside a tile of 8) and row strides (views into a wider buffer)."""
    blocks = pseudo_random_blocks(T.Q4_K)
    whole = torch.ops.pagedserve.quant_repack([blocks], int(T.Q4_K))
    wide = torch.cat([blocks, blocks], dim=1)[:, : blocks.shape[1]]  # rows twice as far apart
    assert wide.stride(0) == 2 * blocks.shape[1]
    for parts in ([blocks[:5], blocks[5:21], blocks[21:]], [wide[:100], blocks[100:]], [wide]):
        assert torch.equal(torch.ops.pagedserve.quant_repack(parts, int(T.Q4_K)), whole)
    with pytest.raises(RuntimeError, match="one width"):
        torch.ops.pagedserve.quant_repack([blocks, blocks[:, :144]], int(T.Q4_K))
