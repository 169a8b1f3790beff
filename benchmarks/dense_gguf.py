"""Write a random-weight dense GGUF of a size users run, in a Q4_K_M-like mix, without a hub:
the 1B and 3B files of docs/benchmarks.md's "The models users bring" and the
beam-search cost on a model users bring.

Llama-3.2-1B's and -3B's widths (hidden, layers, heads, MLP) in Qwen3's layout (q/k norms),
SmolLM2's tokenizer and vocabulary, the embedding tied; weights and types from
benchmarks/moe.py (random_tensors: std 0.02, norms 1; q4_k_m_like: Q4_K, with Q6_K for
attn_v, ffn_down and the embedding), written by pagedserve.model.gguf_write. llama-server
loads the files as they are.

    .venv/bin/python benchmarks/dense_gguf.py --size 1b --out dense1b-q4km.gguf   # 673 MiB, ~50 s
    .venv/bin/python benchmarks/dense_gguf.py --size 3b --out dense3b-q4km.gguf   # 1,827 MiB, ~1 min
"""
from __future__ import annotations

import argparse
import time

from moe import VOCAB, q4_k_m_like, random_tensors  # benchmarks/ is on sys.path when run as a script

from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_write import write_gguf
from pagedserve.model.registry import default_model_path

# hidden, layers, query heads, KV heads, head_dim, MLP width
SIZES = {"1b": (2048, 16, 32, 8, 64, 8192), "3b": (3072, 28, 24, 8, 128, 8192)}


def config(size: str) -> ModelConfig:
    hidden, layers, heads, kv_heads, head_dim, mlp = SIZES[size]
    return ModelConfig(architecture="qwen3", vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=5e5,
                       max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True, intermediate_size=mlp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    c = config(args.size)
    start = time.perf_counter()
    write_gguf(args.out, c, random_tensors(c), default_model_path(), q4_k_m_like)
    print(f"{args.out}: {c.num_params / 1e9:.2f}B parameters, written in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
