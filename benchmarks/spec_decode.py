"""Does speculation pay on this CPU? Output tokens/s with and without it, in one run.

  * n-gram prompt lookup, single stream, on copy-heavy prompts (the model is asked
    to repeat or lightly edit a passage, so its output copies its input);
  * self-draft ("self:N": the target's first N layers plus its head) at concurrency
    1, 4 and 16 on ordinary chat prompts.
Greedy, fixed output length, the same prompts for every configuration; each row
reports tokens/s, the speedup over no speculation measured right before it, the
acceptance rate and the mean tokens per verified draft.

    .venv/bin/python benchmarks/spec_decode.py [--max-tokens 96] [--self-layers 8]
"""
from __future__ import annotations

import argparse
import time

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.loader import load_model
from pagedserve.sampling_params import SamplingParams

PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed to "
    "postpone the vote until the next meeting, when the final figures from the finance office will be available.",
    "To install the package, download the archive, unpack it into a new folder, and run the setup script. "
    "If the script reports a missing library, install that library first and run the script again.",
    "Photosynthesis converts light energy into chemical energy. Plants take in carbon dioxide and water, and "
    "with the help of sunlight they produce glucose and release oxygen into the air.",
    "The train leaves the central station at eight in the morning and arrives at the coast shortly before noon. "
    "Passengers who want a seat by the window should book at least two days in advance.",
]
COPY_TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
              "Fix any typos in the following text and return it unchanged otherwise:\n\n{}"]
CHAT = ["Explain how a bicycle gear works.", "Write a short poem about the sea.",
        "What are three tips for learning a language?", "Describe a sunrise in the mountains.",
        "How do vaccines train the immune system?", "Give a recipe for a simple tomato soup.",
        "Why is the sky blue?", "Summarise the plot of a detective story you invent."]


def chat_prompt(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def run(loaded, prompts: list[str], concurrency: int, max_tokens: int, spec: dict | None) -> dict:
    engine = LLMEngine(EngineConfig(speculative_config=spec, max_num_seqs=max(concurrency, 1)), loaded=loaded)
    ids = [chat_prompt(engine, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending, produced = list(ids), 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.scheduler.running) + len(engine.scheduler.waiting) < concurrency:
            engine.add_request(pending.pop(0), params)
        for delta in engine.step():
            produced += sum(len(s.token_ids) for s in delta.samples)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {"tok_s": produced / elapsed, "acceptance": stats.get("spec_acceptance_rate"),
            "mean_len": stats.get("spec_mean_acceptance_length")}


def row(name: str, base: dict, spec: dict) -> str:
    return (f"| {name} | {base['tok_s']:.1f} | {spec['tok_s']:.1f} | **{spec['tok_s'] / base['tok_s']:.2f}x** | "
            f"{spec['acceptance']:.0%} | {spec['mean_len']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--self-layers", type=int, default=8)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    args = ap.parse_args()
    loaded = load_model()
    k = args.num_speculative_tokens
    print("| workload | tok/s off | tok/s on | speedup | acceptance | tokens per draft |")
    print("|---|---|---|---|---|---|")
    copy_prompts = [t.format(p) for t in COPY_TASKS for p in PASSAGES]
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    base = run(loaded, copy_prompts, 1, args.max_tokens, None)
    print(row(f"ngram k={k}, copy-heavy, concurrency 1", base, run(loaded, copy_prompts, 1, args.max_tokens, ngram)),
          flush=True)
    draft = {"method": "draft_model", "model": f"self:{args.self_layers}", "num_speculative_tokens": k}
    for concurrency in (1, 4, 16):
        prompts = (CHAT * 2)[: max(concurrency * 2, 4)]
        base = run(loaded, prompts, concurrency, args.max_tokens, None)
        spec = run(loaded, prompts, concurrency, args.max_tokens, draft)
        print(row(f"self:{args.self_layers} k={k}, chat, concurrency {concurrency}", base, spec), flush=True)


if __name__ == "__main__":
    main()
