"""MoE experts on GGUF blocks with int8 activations (moe_experts_int8, kernels/csrc/
moe_experts.cpp): the arithmetic --quantization gguf gives the dense layers. A token's
output must be, bit for bit, what quant_linear gives for its experts' matrices applied to
that token's row alone (gate and up, silu_mul, down, then each result added in ascending
expert id as one fma of its router weight), on every instruction-set path, in any batch;
and a tiny MoE GGUF under quantization gguf runs its experts so, batch-invariantly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import busy_batch_bits, make_llm
from gguf import GGMLQuantizationType as T
from kernel_paths import outputs_on_every_path
from test_moe import make_reference
from test_moe_gguf import GGUF_MOE, expert_blocks, load_config, q4_k_m_like

from pagedserve.kernels import native_paths, resolve_kernels
from pagedserve.model.gguf_write import write_gguf
from pagedserve.model.loader import load_model
from pagedserve.model.moe import MoE, QuantExperts, route
from pagedserve.model.moe_config import MoEConfig
from pagedserve.model.quant import NATIVE_TYPES

resolve_kernels("native")  # a broken build fails these tests rather than skipping them

E, TOP_K = 6, 2
# K-quant (and IQ4_XS) rows are whole 256-value super-blocks; the others take smaller, uneven
# shapes (gate/up 5 whole 4-tile groups, down 3).
SHAPES = {True: (256, 256), False: (96, 160)}  # (hidden, expert size) by "some matrix is a K-quant"
K_QUANTS = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS}


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), rounded once: the float64 product is exact, the float64 sum is
    rounded to odd (TwoSum gives its exact error), which float32 then rounds correctly."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    v = s - p
    err = (p - (s - v)) + (c - v)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def quant_linear_reference(x, weights, experts, g: QuantExperts, u: QuantExperts, d: QuantExperts) -> torch.Tensor:
    """Each row alone through quant_linear on its experts' tiles, results added in ascending id."""
    ops = torch.ops.pagedserve
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        for w, e in sorted(zip(weights[t].tolist(), experts[t].tolist()), key=lambda pair: pair[1]):
            gu = torch.cat([ops.quant_linear(row, g.packed[e], g.qtype, g.out_features, None),
                            ops.quant_linear(row, u.packed[e], u.qtype, u.out_features, None)], dim=-1)
            y = ops.quant_linear(ops.silu_mul(gu), d.packed[e], d.qtype, d.out_features, None)[0]
            out[t] = fma32(torch.tensor(w, dtype=torch.float32).expand_as(y), y, out[t])
    return out


def expert_stacks(types: tuple[T, T, T], seed: int) -> tuple[list[QuantExperts], int, int]:
    h, i = SHAPES[bool(K_QUANTS & set(types))]
    rng = np.random.default_rng(seed)
    shapes = ((E, i, h), (E, i, h), (E, h, i))
    return [QuantExperts(expert_blocks(rng, s, t), int(t), "int8") for s, t in zip(shapes, types)], h, i


def run_int8(stacks: list[QuantExperts], i: int):
    args = [a for s in stacks for a in (s.packed, s.qtype)]

    def run(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedserve.moe_experts_int8(x, experts, weights, *args, i)
    return run


def routed(rows: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    x[1] = 0  # a row of zeros: every activation scale 0
    weights, experts = route(torch.randn(rows, E, generator=gen) * 3, TOP_K, normalize=True)
    return x, weights, experts


TYPE_CASES = [(t, t, t) for t in sorted(NATIVE_TYPES)] + [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_0, T.Q4_1),
                                                          (T.Q5_1, T.Q8_0, T.Q4_0)]


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("types", TYPE_CASES, ids=lambda ts: "-".join(T(t).name for t in ts))
def test_int8_experts_are_quant_linear_on_each_row_alone(types, isa, monkeypatch):
    """Exact, for every type the experts can hold (each of gate, up and down its own), with
    the op and the reference both on `isa` (auto: the widest this CPU has)."""
    if isa == "avx2":
        monkeypatch.setenv("PAGEDSERVE_NATIVE_ISA", "avx2")
    else:
        monkeypatch.delenv("PAGEDSERVE_NATIVE_ISA", raising=False)
    stacks, h, i = expert_stacks(tuple(T(t) for t in types), seed=int(types[0]) * 10 + int(types[2]))
    x, weights, experts = routed(9, h, seed=int(types[1]))
    got = run_int8(stacks, i)(x, weights, experts)
    want = quant_linear_reference(x, weights, experts, *stacks)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q5_K, T.Q6_K), (T.Q8_0, T.Q4_1, T.Q5_0)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_int8_experts_bits_do_not_depend_on_batch_threads_or_instruction_set(types):
    """The same bits for every row on every path this CPU has (VNNI's four-tile quads and
    AVX2's single tiles), on 1 and 2 threads, alone or in batches that give each expert
    from none to many rows; and the path taken is the one the CPU offers."""
    stacks, h, i = expert_stacks(types, seed=7)
    x, weights, experts = routed(200, h, seed=8)
    run = run_int8(stacks, i)
    packed = torch.cat([x, weights, experts.double().float()], dim=1)  # rows sliced together

    def op(rows: torch.Tensor) -> torch.Tensor:
        return run(rows[:, :h].contiguous(), rows[:, h:h + TOP_K].contiguous(), rows[:, h + TOP_K:].long())

    results = outputs_on_every_path(op, packed, (200, 33, 7, 6, 5, 2, 1))
    for y in results:
        assert torch.equal(y, results[0][: y.shape[0]])
    paths = native_paths()
    assert "moe_experts_int8:avx2" in paths.taken
    assert ("moe_experts_int8:avx512_vnni" in paths.taken) == ("moe_experts_int8:avx512_vnni" in paths.available)


def test_int8_experts_read_only_the_selected_experts_and_refuse_half_types():
    stacks, h, i = expert_stacks((T.Q4_K, T.Q4_K, T.Q6_K), seed=3)
    x = torch.randn(4, h)
    experts = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0]])
    weights = torch.full((4, 2), 0.5)
    run = run_int8(stacks, i)
    before = run(x, weights, experts)
    for s in stacks:  # every other expert's scales become NaN: reading any of them would show
        s.packed[[1, 3, 4, 5]] = 0xFF
    after = run(x, weights, experts)
    assert torch.equal(before, after) and torch.isfinite(after).all()
    args = [a for s in stacks for a in (s.packed, s.qtype)]
    args[1] = int(T.F16)
    with pytest.raises(RuntimeError, match="no int8 form"):
        torch.ops.pagedserve.moe_experts_int8(x, experts, weights, *args, i)


def test_the_layer_takes_the_op_of_its_experts_arithmetic(monkeypatch):
    """MoE.forward: int8 experts run moe_experts_int8 and say so in the start-up log's words;
    fp32 ones (quantization none) keep moe_experts."""
    stacks, h, i = expert_stacks((T.Q8_0, T.Q8_0, T.Q8_0), seed=5)
    moe = MoE(MoEConfig(E, TOP_K, i, True, (0,)), h, torch.nn.Linear(h, E, bias=False))
    moe.gate, moe.up, moe.down = stacks
    x = torch.randn(3, h)
    calls = count_op_calls(monkeypatch)
    with torch.no_grad():
        int8 = moe(x)
    assert moe.weight_paths() == ["expert stack on Q8_0 blocks (int8 arithmetic)"] * 3
    for s in stacks:
        s.activations = "fp32"
    with torch.no_grad():
        fp32 = moe(x)
    assert calls == {"moe_experts_int8": 1, "moe_experts": 1}
    assert moe.weight_paths() == ["expert stack on Q8_0 blocks (fp32 arithmetic)"] * 3
    assert not torch.equal(int8, fp32)  # two arithmetics: the int8 one rounds the activations


def count_op_calls(monkeypatch) -> dict[str, int]:
    """Calls of the two experts ops from here on (each still runs)."""
    calls = {"moe_experts_int8": 0, "moe_experts": 0}
    for name in calls:
        op = getattr(torch.ops.pagedserve, name)

        def counted(*args, _op=op, _name=name):
            calls[_name] += 1
            return _op(*args)
        monkeypatch.setattr(torch.ops.pagedserve, name, counted)
    return calls


def test_a_tiny_moe_gguf_under_quantization_gguf_runs_int8_experts_batch_invariantly(gguf_path, tmp_path,
                                                                                   monkeypatch):
    """Qwen3-MoE (a dense layer beside sparse ones), Q4_K_M-like: the engine's greedy tokens
    and their logprobs' bits are the same alone and inside a busy batch, and the experts ran
    on the int8 op."""
    tokenizer = load_model(gguf_path).tokenizer
    ref = make_reference("qwen3_moe", tokenizer.vocab_size, **GGUF_MOE, moe_intermediate_size=GGUF_MOE[
        "intermediate_size"], head_dim=64)
    path = tmp_path / "qwen3_moe.gguf"
    write_gguf(path, load_config(ref, tmp_path), dict(ref.state_dict()), gguf_path, q4_k_m_like)
    loaded = load_model(path, use_cache=False, quantization="gguf")
    described = loaded.model.describe_weights()
    assert "expert stack on Q4_K blocks (int8 arithmetic)" in described
    assert "expert stack on Q6_K blocks (int8 arithmetic)" in described and "fp32 arithmetic" not in described
    calls = count_op_calls(monkeypatch)
    tokens = busy_batch_bits(make_llm(loaded))
    assert calls["moe_experts_int8"] > 0 and calls["moe_experts"] == 0
    assert "moe_experts_int8:avx2" in native_paths().taken or "moe_experts_int8:avx512_vnni" in native_paths().taken
    assert all(len(t) == 8 for t in tokens)
