"""What multi-LoRA batching costs: a 32-request batch spread over 4 adapters against the
same batch on the base model alone, on one engine.

The two runs alternate (base, LoRA, base, LoRA, ...) so drift on a shared machine hits
both alike; each round's ratio is LoRA tok/s over the base run just before it, and the
median of the rounds is reported. Greedy, fixed output length, the same prompts both
ways; the prefix cache is off so every round computes the whole prompts. Adapters are
random PEFT adapters (peft, on the model's architecture) of --rank over every
q/k/v/o/gate/up/down projection, written to a temporary folder.

    .venv/bin/python benchmarks/lora.py [--rounds 3] [--max-tokens 64] [--rank 16] [--quantization none]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.bench.lora_adapters import write_random_adapter
from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.loader import load_model
from pagedserve.sampling_params import SamplingParams

NUM_REQUESTS = 32
NUM_ADAPTERS = 4
TOPICS = ["a bicycle gear", "the sea", "learning a language", "a sunrise", "vaccines", "tomato soup",
          "the blue sky", "a detective story"]


def run(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> float:
    """Output tokens per second for the whole batch, all added at once."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for ids, lora in zip(prompts, loras):
        engine.add_request(ids, params, lora_name=lora)
    produced = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            produced += sum(len(s.token_ids) for s in delta.samples)
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()

    loaded = load_model(quantization=args.quantization)
    with tempfile.TemporaryDirectory() as tmp:
        modules = {f"adapter{i}": str(write_random_adapter(Path(tmp) / f"adapter{i}", loaded.config, rank=args.rank,
                                                           alpha=2 * args.rank, seed=i))
                   for i in range(NUM_ADAPTERS)}
        engine = LLMEngine(EngineConfig(enable_lora=True, lora_modules=modules, max_loras=NUM_ADAPTERS,
                                        max_lora_rank=args.rank, max_num_seqs=NUM_REQUESTS,
                                        enable_prefix_caching=False, quantization=args.quantization), loaded=loaded)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Tell me about {TOPICS[i % 8]} "
                                                    f"(note {i})."}])) for i in range(NUM_REQUESTS)]
    adapters = [f"adapter{i % NUM_ADAPTERS}" for i in range(NUM_REQUESTS)]
    run(engine, prompts[:4], [None, *adapters[:3]], 4)  # warm-up
    ratios = []
    print(f"{NUM_REQUESTS} requests, {args.max_tokens} output tokens each, {NUM_ADAPTERS} adapters of rank "
          f"{args.rank} (all 7 projections), quantization {args.quantization}, {engine.kernels} kernels")
    for r in range(args.rounds):
        base = run(engine, prompts, [None] * NUM_REQUESTS, args.max_tokens)
        lora = run(engine, prompts, adapters, args.max_tokens)
        ratios.append(lora / base)
        print(f"round {r + 1}: base {base:7.1f} tok/s   4 adapters {lora:7.1f} tok/s   ratio {lora / base:.3f}")
    print(f"median ratio (LoRA / base): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
