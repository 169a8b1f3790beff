"""Triton kernels for paged attention and the fused KV-cache write (docs/gpu-kernels.md).

Imported only by TritonPagedAttention, lazily: importing this module imports triton,
and triton decides at decoration time whether the kernels run compiled (CUDA tensors)
or in its interpreter (TRITON_INTERPRET=1, CPU tensors).

The cache (one layer's, as core/kv_tensor_layout.py lays it out) is of fp32, fp16, bf16
or fp8 (e4m3fn / e5m2). Reads widen to fp32. Writes round to nearest even and saturate
like `backend.to_cache_dtype`, in integer arithmetic on the fp32 bits, so compiled and
interpreted runs store the bits torch's conversion stores (triton's own narrowing casts
differ between the two: the interpreter truncates to bf16, and fp8 rounding and
saturation depend on the GPU generation).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..core.kv_tensor_layout import KVTensorLayout

# (exponent bits, mantissa bits, largest finite value or 0 for "no clamp") of the
# narrow cache types the write kernel encodes.
_ENCODINGS = {
    torch.float16: (5, 10, 65504.0),
    torch.bfloat16: (8, 7, 0.0),
    torch.float8_e4m3fn: (4, 3, 448.0),
    torch.float8_e5m2: (5, 2, 57344.0),
}
# The integer views the write kernel stores encoded bits through.
_BITS_VIEW = {1: torch.uint8, 2: torch.int16}
CACHE_DTYPES = (torch.float32, *_ENCODINGS)


@triton.jit
def _encode(x, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, MAX_FINITE: tl.constexpr):
    """fp32 -> the bits of a float with EXP_BITS/MAN_BITS (IEEE-style bias, subnormals),
    rounded to nearest even, clamped to +-MAX_FINITE first when it is non-zero."""
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    SHIFT: tl.constexpr = 23 - MAN_BITS
    clamped = x
    if MAX_FINITE > 0:
        clamped = tl.minimum(tl.maximum(x, -MAX_FINITE), MAX_FINITE)
    u = clamped.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    a = u & 0x7FFFFFFF
    e32 = a >> 23
    # Normal in the target: rebias the exponent, drop SHIFT mantissa bits (a carry out
    # of the mantissa correctly bumps the exponent).
    rebased = a - ((127 - BIAS) << 23)
    normal = (rebased + ((1 << (SHIFT - 1)) - 1) + ((rebased >> SHIFT) & 1)) >> SHIFT
    # Subnormal in the target: the significand counted in units of the smallest
    # subnormal; rounding up to 1 << MAN_BITS is exactly the smallest normal's bits.
    significand = (a & 0x7FFFFF) | tl.where(e32 > 0, 0x800000, 0)
    # Clamped to [1, 25] so that no lane shifts by a negative or oversized amount (lanes
    # that take the normal branch would, and a GPU shift is undefined there); from 25 on
    # the result is 0 anyway.
    sh = tl.maximum(tl.minimum(151 - BIAS - MAN_BITS - tl.maximum(e32, 1), 25), 1)
    sub = (significand + (1 << (sh - 1)) - 1 + ((significand >> sh) & 1)) >> sh
    bits = tl.where(e32 < 128 - BIAS, sub, normal) | (sign << (EXP_BITS + MAN_BITS))
    nan_bits = ((1 << (EXP_BITS + MAN_BITS)) - 1)  # all exponent and mantissa bits: a NaN in every target
    return tl.where(x != x, nan_bits, bits)


@triton.jit
def write_kv_kernel(
    cache_ptr, k_ptr, v_ptr, slot_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ENCODE: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, MAX_FINITE: tl.constexpr,
):
    """One program per token: its K and V rows of every KV head into its slot.
    A negative slot (a padding row) writes nothing."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, HEAD_DIM_P)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
        dst = dst + heads[:, None] * stride_c_head + dims[None, :]
        k = tl.load(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if ENCODE:
            k_bits = _encode(k, EXP_BITS, MAN_BITS, MAX_FINITE)
            v_bits = _encode(v, EXP_BITS, MAN_BITS, MAX_FINITE)
            tl.store(dst, k_bits.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + stride_c_kv, v_bits.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dst, k, mask=mask)
            tl.store(dst + stride_c_kv, v, mask=mask)


@triton.jit
def _sequence_of(program, query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold `program`: sequence i owns programs
    query_start_loc[i] // BLOCK_Q + i onwards (a strictly increasing bound, so the
    grid needs no host-side list of blocks), found by binary search."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_program = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_program <= program
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2, num_seqs,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, NUM_HEADS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (p, h, s): up to BLOCK_Q consecutive query tokens of one sequence, times
    the GROUP query heads that share KV head h, as one BLOCK_M-row tile. It walks its
    share s of the sequence's block table one cache block at a time, loading each K/V
    tile once for all its rows, with an online softmax; causal over the chunk, full over
    the context. With one segment it writes the output; with more (split-KV decode) it
    writes its unnormalised partial and its running max and sum for reduce_segments_kernel.

    Over 80 lines because it is one compiled program: its twenty pointer, stride and
    constexpr parameters take ten lines, and the tile walk with its online softmax reads
    as one loop; @triton.jit helpers would hand the same tiles and running state back and
    forth (they inline anyway) and split what has to be checked together."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _sequence_of(program, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_begin
    first = (program - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if first < query_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
        context_len = seq_len - query_len

        rows = tl.arange(0, BLOCK_M)
        tok = first + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < query_len)
        dims = tl.arange(0, HEAD_DIM_P)
        dim_ok = dims < HEAD_DIM
        q_rows = q_ptr + (q_begin + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head
        q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = context_len + tok

        # The last key any row of this tile may see, and the blocks that hold them.
        kv_end = context_len + tl.minimum(first + BLOCK_Q, query_len)
        num_blocks = (kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE
        per_segment = (num_blocks + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        j_begin = segment * per_segment
        j_end = tl.minimum(j_begin + per_segment, num_blocks)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        offs = tl.arange(0, BLOCK_SIZE)
        table = block_tables_ptr + seq * stride_bt_seq
        for j in range(j_begin, j_end):
            block = tl.load(table + j).to(tl.int64)
            k_pos = j * BLOCK_SIZE + offs
            # Slots past the context are unwritten memory (maybe NaN bits): never load them,
            # or 0 * NaN would reach the accumulator.
            kv_mask = (k_pos < seq_len)[:, None] & dim_ok[None, :]
            tile = cache_ptr + block * stride_c_block + kv_head * stride_c_head
            tile = tile + offs[:, None] * stride_c_slot + dims[None, :]
            k = tl.load(tile, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)
            v = tl.load(tile + stride_c_kv, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)

            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen no key yet (padding rows) keep m = -inf: subtract 0 instead.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        if NUM_SEGMENTS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_rows = out_ptr + (q_begin + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head
            tl.store(o_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:
            # Every segment writes, an empty one too (max -inf, sum 0): the reduce reads all.
            part = ((q_begin + tok) * NUM_HEADS + head) * NUM_SEGMENTS + segment
            tl.store(part_max_ptr + part, m_i, mask=row_ok)
            tl.store(part_sum_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    """Program (t, h): merge the segments of token t, head h by log-sum-exp."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_P)
    part = (tok * NUM_HEADS + head) * NUM_SEGMENTS + segs
    seg_max = tl.load(part_max_ptr + part)
    top = tl.max(seg_max, 0)
    weight = tl.math.exp2(seg_max - tl.where(top == float("-inf"), 0.0, top))  # empty segments: 0
    total = tl.sum(tl.load(part_sum_ptr + part) * weight, 0)
    acc = tl.sum(tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :]) * weight[:, None], 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_ptr = out_ptr + tok * stride_o_tok + head * stride_o_head + dims
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


INTERPRETED = isinstance(paged_attention_kernel, InterpretedFunction)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [num_tokens, num_kv_heads, head_dim] at their slots (negative: skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    layout = KVTensorLayout.of(kv_cache)
    encoding = _ENCODINGS.get(kv_cache.dtype)
    target = kv_cache if encoding is None else kv_cache.view(_BITS_VIEW[kv_cache.element_size()])
    exp_bits, man_bits, max_finite = encoding or (8, 23, 0.0)
    write_kv_kernel[(num_tokens,)](
        target, k, v, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=layout.block_size,
        ENCODE=encoding is not None, EXP_BITS=exp_bits, MAN_BITS=man_bits, MAX_FINITE=max_finite,
    )


def tile_rows(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per program and tile rows (a power of two, at
    least 16 for tl.dot). Decode-only steps take the smallest tile that holds one
    token's group; steps with longer queries take 64 rows so each K/V tile serves
    more of them."""
    rows = max(16, triton.next_power_of_2(group)) if max_query_len <= 1 else max(64, triton.next_power_of_2(group))
    return rows // group, rows


# Split-KV decode: with fewer (sequence, KV head) programs than this, a GPU's SMs
# (132 on an H100 or H200) would idle, so each program's context is cut into segments.
SPLIT_BELOW_PROGRAMS = 128
DECODE_SEGMENTS = 16


def num_segments(num_seqs: int, num_kv_heads: int, max_query_len: int, decode_segments: int) -> int:
    """Segments per (sequence, KV head) program. Decided from the step's shape alone,
    never its context lengths (device values), so a captured decode graph stays right
    for any context: the kernel splits each context into this many parts itself."""
    if max_query_len <= 1 and num_seqs * num_kv_heads < SPLIT_BELOW_PROGRAMS:
        return decode_segments
    return 1


def paged_attention(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int, segments: int,
) -> None:
    """out[t, h*D:(h+1)*D] = attention of q[t, h] over its sequence's cached context,
    each (query block, KV head) program's context cut into `segments` (a power of two;
    1 for steps with prefill chunks: num_segments)."""
    num_tokens, num_heads, head_dim = q.shape
    layout = KVTensorLayout.of(kv_cache)
    num_kv_heads = layout.num_kv_heads
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return
    group = num_heads // num_kv_heads
    block_q, block_m = tile_rows(group, max_query_len)
    head_dim_p = triton.next_power_of_2(head_dim)
    out_heads = out.view(num_tokens, num_heads, head_dim)
    if segments > 1:
        part_acc = q.new_empty(num_tokens, num_heads, segments, head_dim_p, dtype=torch.float32)
        part_max = q.new_empty(num_tokens, num_heads, segments, dtype=torch.float32)
        part_sum = q.new_empty(num_tokens, num_heads, segments, dtype=torch.float32)
    else:
        part_acc = part_max = part_sum = out  # not read: the kernel writes `out` itself
    # The interpreter multiplies bf16/fp16 operands as their raw integer bits: there
    # the dots take fp32 (docs/gpu-kernels.md: what only a GPU verifies).
    dot_fp32 = q.dtype == torch.float32 or INTERPRETED
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
    paged_attention_kernel[grid](
        out_heads, part_acc, part_max, part_sum, q, kv_cache, block_tables, query_start_loc, seq_lens,
        scale * 1.4426950408889634, num_seqs,  # log2(e): the kernel works in exp2
        q.stride(0), q.stride(1), out_heads.stride(0), out_heads.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=layout.block_size,
        NUM_SEGMENTS=segments, NUM_HEADS=num_heads, DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32",
    )
    if segments > 1:
        reduce_segments_kernel[(num_tokens, num_heads)](
            out_heads, part_acc, part_max, part_sum, out_heads.stride(0), out_heads.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SEGMENTS=segments,
        )
