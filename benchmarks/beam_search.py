"""Beam search's cost against greedy decoding: time per output token at C concurrent requests.

    .venv/bin/python benchmarks/beam_search.py [--model PATH] [--concurrency 8] [--beam-width 4]
        [--max-tokens 64] [--prompt-tokens 128] [--reps 3] [--threads N] [--quantization none]

One engine, one process. Each rep runs the same C prompts twice, greedy (n=1) and beam
search (beam_width W, the best beam returned), interleaved so that load from other
processes hits both alike; both run to max_tokens (ignore_eos: the beams stop on length
alone, as greedy does), so each request outputs max_tokens tokens either way and the
figure is wall time / (C * max_tokens). The goal: beam width 4 costs at
most 1.5x greedy's time per output token at 8 concurrent requests. Prints the median
of each and their ratio, and checks that every beam request returned max_tokens tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedserve import LLM, SamplingParams

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
        "books were made, who could read them and how fast ideas could travel across Europe. ")


def _prompts(llm: LLM, count: int, num_tokens: int) -> list[list[int]]:
    base = llm.tokenizer.encode(TEXT * (num_tokens // 20 + 2))
    # Distinct prompts (no prefix-cache hits between them): each starts with its own number.
    return [llm.tokenizer.encode(f"Document {i}: ") + base[: num_tokens] for i in range(count)]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [len(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the shipped GGUF)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    options: dict = {}
    if args.concurrency * args.beam_width > 128:  # every beam holds a seat (max_num_seqs, default 128)
        options["max_num_seqs"] = args.concurrency * args.beam_width
    if args.threads is not None:
        options["num_threads"] = args.threads
    if args.quantization is not None:
        options["quantization"] = args.quantization
    llm = LLM(args.model, **options)
    prompts = _prompts(llm, args.concurrency, args.prompt_tokens)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    beam = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, n=1,
                          beam_width=args.beam_width)
    _timed(llm, prompts[:1], greedy)  # warm-up: first-call allocations and kernel paths
    _timed(llm, prompts[:1], beam)
    times: dict[str, list[float]] = {"greedy": [], "beam": []}
    for _ in range(args.reps):
        for name, params in (("greedy", greedy), ("beam", beam)):
            seconds, lengths = _timed(llm, prompts, params)
            if lengths != [args.max_tokens] * args.concurrency:
                raise SystemExit(f"{name}: output lengths {lengths}, expected {args.max_tokens} each")
            times[name].append(seconds)
    tokens = args.concurrency * args.max_tokens
    per_token = {name: statistics.median(t) / tokens * 1000 for name, t in times.items()}
    print(f"{args.concurrency} concurrent requests, {args.prompt_tokens}-token prompts, {args.max_tokens} output "
          f"tokens each, {args.reps} interleaved reps (median)")
    print(f"greedy:             {per_token['greedy']:.2f} ms per output token")
    print(f"beam width {args.beam_width}:       {per_token['beam']:.2f} ms per output token")
    ratio = per_token["beam"] / per_token["greedy"]
    print(f"ratio:              {ratio:.2f}x greedy (target <= 1.5x)")
    stats = llm.stats()
    if stats["kv_free_blocks"] != stats["kv_total_blocks"]:
        raise SystemExit(f"blocks leaked: {stats['kv_total_blocks'] - stats['kv_free_blocks']} still held")


if __name__ == "__main__":
    main()
