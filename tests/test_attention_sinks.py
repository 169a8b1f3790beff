"""Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax
denominator with no value. Every backend that takes them against a float64 reference,
on decodes, short queries and prefill chunks, with and without a sliding window; the
backends that cannot take them refuse them by name."""
from __future__ import annotations

import pytest
import torch

from kernel_paths import outputs_on_every_path
from pagedserve.attention.backend import ReferenceBackend, write_kv
from pagedserve.attention.contiguous_backend import ContiguousAttention, NativeContiguousAttention
from pagedserve.attention.cpu_backend import CpuPagedAttention
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.native_backend import NativePagedAttention
from pagedserve.attention.testing import random_step
from pagedserve.core.kv_tensor_layout import KVTensorLayout
from pagedserve.kernels import native_unavailable_reason

# Decodes short and past several 256-key partitions (a split sequence's merge), a short
# query, and prefill chunks with and without earlier context.
SEQS = [(1, 1), (1, 17), (1, 700), (5, 40), (40, 40), (60, 300)]
WINDOWS = pytest.mark.parametrize("window", [0, 24, 300], ids=["full", "window24", "window300"])


@pytest.fixture(scope="module", autouse=True)
def native_library():
    assert native_unavailable_reason() is None


def float64_reference(q, cache, meta, scale, window, sinks) -> torch.Tensor:
    """softmax([scores, sink]) without the sink's column, times V, all in float64."""
    layout = KVTensorLayout.of(cache)
    group = q.shape[1] // layout.num_kv_heads
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        blocks = meta.block_tables[i, : -(-slen // meta.block_size)]
        keys = layout.keys(cache)[blocks].reshape(-1, *layout.token_shape)[:slen].double()
        vals = layout.values(cache)[blocks].reshape(-1, *layout.token_shape)[:slen].double()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[starts[i]: starts[i] + qlen].double().transpose(0, 1)
        scores = qs @ keys.transpose(1, 2) * scale
        q_pos, k_pos = torch.arange(slen - qlen, slen).unsqueeze(1), torch.arange(slen).unsqueeze(0)
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        with_sink = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, qlen, 1)], dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :-1]
        out[starts[i]: starts[i] + qlen] = (probs @ vals).transpose(0, 1).reshape(qlen, -1)
    return out


def step_with_sinks(seqs, seed: int = 0):
    q, k, v, cache, meta = random_step(seqs, 8, 2, 64, 16, seed=seed)
    # Sinks around the scores' own size (some well above: those rows give most weight to the sink).
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 3
    return q, k, v, cache, meta, sinks


@WINDOWS
@pytest.mark.parametrize("backend", [ReferenceBackend, CpuPagedAttention, NativePagedAttention],
                         ids=["reference", "cpu", "native"])
def test_paged_backends_match_the_float64_reference(backend, window):
    q, k, v, cache, meta, sinks = step_with_sinks(SEQS)
    got = backend().forward(q, k, v, cache, meta, 0.125, window, 0.0, sinks)
    expected = float64_reference(q, cache, meta, 0.125, window, sinks)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # The sinks take weight from the keys: without them the rows differ.
    without = backend().forward(q, k, v, cache.clone(), meta, 0.125, window, 0.0)
    assert not torch.allclose(without, got, atol=1e-3)


def contiguous_step(seqs, seed: int = 0):
    """A step under the contiguous layout: each sequence's blocks consecutive."""
    q, k, v, _, _, sinks = step_with_sinks(seqs, seed)
    tables, base = [], 0
    for _, seq_len in seqs:
        n = -(-seq_len // 16)
        tables.append(list(range(base, base + n)))
        base += n
    meta = AttentionMetadata.for_sequences([ql for ql, _ in seqs], [s for _, s in seqs], tables, 16)
    cache = torch.randn(KVTensorLayout(base, 16, 2, 64, torch.float32).shape,
                        generator=torch.Generator().manual_seed(seed + 1))
    return q, k, v, cache, meta, sinks


@pytest.mark.parametrize("backend,window", [(ContiguousAttention, 0), (NativeContiguousAttention, 0),
                                            (NativeContiguousAttention, 24)],
                         ids=["torch", "native", "native-window24"])
def test_contiguous_backends_match_the_float64_reference(backend, window):
    q, k, v, cache, meta, sinks = contiguous_step(SEQS)
    got = backend().forward(q, k, v, cache, meta, 0.125, window, 0.0, sinks)
    torch.testing.assert_close(got.double(), float64_reference(q, cache, meta, 0.125, window, sinks),
                               rtol=1e-5, atol=1e-5)


@WINDOWS
def test_every_instruction_set_path_gives_the_same_bits(window):
    q, k, v, cache, meta, sinks = step_with_sinks(SEQS, seed=1)
    write_kv(k, v, cache, meta.slot_mapping)

    def op(_):
        out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2])
        torch.ops.pagedserve.paged_attention_(out, q, cache, meta.block_tables, meta.query_start_loc,
                                              meta.seq_lens, torch.arange(meta.num_seqs), 0.125, window, 0.0, sinks)
        return out

    outputs = outputs_on_every_path(op, q, [q.shape[0]])
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_a_huge_sink_takes_all_the_weight_without_overflow():
    q, k, v, cache, meta, _ = step_with_sinks([(1, 30), (20, 20)])
    sinks = torch.full((8,), 200.0)
    out = NativePagedAttention().forward(q, k, v, cache, meta, 0.125, 0, 0.0, sinks)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-30


def test_backends_without_sinks_and_bad_sinks_are_refused_by_name():
    from pagedserve.attention.triton_backend import TritonPagedAttention, triton_unavailable_reason

    q, k, v, cache, meta, sinks = step_with_sinks([(1, 20)])
    if triton_unavailable_reason() is None:
        with pytest.raises(ValueError, match="triton attention backend has no attention sinks"):
            TritonPagedAttention().forward(q, k, v, cache, meta, 0.125, 0, 0.0, sinks)
    for backend in (NativePagedAttention(), CpuPagedAttention(), ReferenceBackend()):
        with pytest.raises(ValueError, match=r"sinks must be a float tensor \[8\]"):
            backend.forward(q, k, v, cache, meta, 0.125, 0, 0.0, sinks[:4])
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
        torch.ops.pagedserve.paged_attention_(torch.zeros(1, 512), q, cache, meta.block_tables, meta.query_start_loc,
                                              meta.seq_lens, torch.arange(1), 0.125, 0, 0.0, sinks.double())
