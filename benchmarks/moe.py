"""A mixture of experts against a dense model of its active parameter count, single stream.

Both models are random-weight Qwen3-MoE-shaped GGUFs in a Q4_K_M-like mix (experts' gate
and up Q4_K, down Q6_K; attention Q4_K with v in Q6_K; embedding Q6_K, tied), written by
pagedserve.model.gguf_write with the shipped tokenizer. The MoE ("1b": hidden 1024, 16
layers, 40 experts of 512, top 6) holds ~1.1B parameters of which ~0.24B are active per
token; the dense model has the same attention and embedding and one MLP of 6 x 512 = 3,072,
so it reads what the MoE reads per decode step. Each serves one greedy request at a time
through the engine on its GGUF blocks, both in the same arithmetic (`--quantization`: the
default `auto` is int8 activations, quant_linear and moe_experts_int8; `none` is fp32,
dequant_linear and moe_experts); the two alternate round by round, and each round's ratio is MoE tok/s over the dense run
just before it (the issue's target: the MoE within 1.5x of the dense model, ratio >= 0.67).

    .venv/bin/python benchmarks/moe.py [--size 1b|tiny] [--quantization auto|none] [--rounds 3] [--max-tokens 64] [--dir DIR]

`--size tiny` (hidden 256, 2 layers, 8 experts of 256, top 2) proves the script runs.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_write import write_gguf
from pagedserve.model.moe_config import MoEConfig
from pagedserve.model.registry import default_model_path
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    expert_size: int


SHAPES = {"1b": Shape(1024, 16, 16, 4, 40, 6, 512), "tiny": Shape(256, 2, 4, 2, 8, 2, 256)}
VOCAB = 49152  # the shipped tokenizer's


def configs(s: Shape) -> tuple[ModelConfig, ModelConfig]:
    """(the MoE, the dense model with its active parameter count)."""
    common = dict(vocab_size=VOCAB, hidden_size=s.hidden, num_layers=s.layers, num_heads=s.heads,
                  num_kv_heads=s.kv_heads, head_dim=s.hidden // s.heads, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True)
    moe = MoEConfig(s.experts, s.top_k, s.expert_size, True, tuple(range(s.layers)))
    return (ModelConfig(architecture="qwen3_moe", intermediate_size=s.expert_size, moe=moe, **common),
            ModelConfig(architecture="qwen3", intermediate_size=s.top_k * s.expert_size, **common))


def random_tensors(c: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named random weights (std 0.02, norms 1), one tensor at a time."""
    g = torch.Generator().manual_seed(seed)
    h, d = c.hidden_size, c.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    yield "model.embed_tokens.weight", rand(c.vocab_size, h)
    yield "model.norm.weight", torch.ones(h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(h)
        yield p + "post_attention_layernorm.weight", torch.ones(h)
        yield p + "self_attn.q_norm.weight", torch.ones(d)
        yield p + "self_attn.k_norm.weight", torch.ones(d)
        for name, rows in (("q", c.num_heads * d), ("k", c.num_kv_heads * d), ("v", c.num_kv_heads * d)):
            yield p + f"self_attn.{name}_proj.weight", rand(rows, h)
        yield p + "self_attn.o_proj.weight", rand(h, c.num_heads * d)
        if c.moe is None:
            for name, shape in (("gate", (c.intermediate_size, h)), ("up", (c.intermediate_size, h)),
                                ("down", (h, c.intermediate_size))):
                yield p + f"mlp.{name}_proj.weight", rand(*shape)
        else:
            e, n = c.moe.num_experts, c.moe.expert_size
            yield p + "moe.router.weight", torch.randn(e, h, generator=g)
            for name, shape in (("gate", (e, n, h)), ("up", (e, n, h)), ("down", (e, h, n))):
                yield p + f"moe.{name}.weight", rand(*shape)


def q4_k_m_like(name: str, shape: tuple[int, ...]) -> T:
    if "ffn_gate_inp" in name:
        return T.F32  # llama.cpp never quantises the router
    if "down" in name or "attn_v" in name or name == "token_embd.weight":
        return T.Q6_K
    return T.Q4_K


def decode_tok_s(engine: LLMEngine, max_tokens: int) -> float:
    """One greedy request alone: output tokens per second after its first token."""
    engine.add_request(list(range(1000, 1032)), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, produced = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += sum(len(s.token_ids) for s in out.samples)
            if first is None and produced:
                first, produced = time.perf_counter(), 0
    return produced / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dir", default=None, help="keep (and reuse) the GGUFs here")
    parser.add_argument("--quantization", choices=["auto", "none"], default="auto",
                        help="both models' arithmetic: auto (int8 activations on a GGUF) or none (fp32)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        engines = {}
        for config in configs(SHAPES[args.size]):
            path = folder / f"{args.size}-{config.architecture}.gguf"
            if not path.is_file():
                write_gguf(path, config, random_tensors(config), default_model_path(), q4_k_m_like)
            print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {config.num_params / 1e6:.0f}M active params")
            engines[config.architecture] = LLMEngine(EngineConfig(model=str(path), quantization=args.quantization,
                                                                  kv_cache_memory="256MiB", max_model_len=1024))
            print(f"  weights: {engines[config.architecture].loaded.model.describe_weights()}")
        ratios = []
        for r in range(args.rounds):
            dense = decode_tok_s(engines["qwen3"], args.max_tokens)
            moe = decode_tok_s(engines["qwen3_moe"], args.max_tokens)
            ratios.append(moe / dense)
            print(f"round {r}: dense {dense:.1f} tok/s, MoE {moe:.1f} tok/s, MoE / dense {moe / dense:.2f}")
        print(f"median MoE / dense: {statistics.median(ratios):.2f} (target >= 0.67: within 1.5x)")


if __name__ == "__main__":
    main()
