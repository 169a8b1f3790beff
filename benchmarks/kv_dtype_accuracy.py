"""What a narrower KV cache (`--kv-cache-dtype`) costs in accuracy, through the real engine:

  * perplexity on tests/data/apache-2.0.txt in windows of --window tokens, from the
    engine's prompt logprobs (prefilled in 256-token chunks, so every chunk after the
    first reads the earlier ones back from the narrow cache);
  * greedy agreement with the fp32 cache over the held-in reference prompts: tokens equal
    to fp32's before the first difference, and prompts whose whole continuation is fp32's;
  * how many tokens the same --kv-cache-memory holds.

    .venv/bin/python benchmarks/kv_dtype_accuracy.py [--dtypes fp32,fp16,fp8_e4m3,fp8_e5m2]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from reference_prompts import REFERENCE_TEXTS  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.engine_config import EngineConfig  # noqa: E402
from pagedserve.engine.llm import LLM  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402

TEXT = ROOT / "tests" / "data" / "apache-2.0.txt"


def engine_llm(loaded, kv_cache_dtype: str, memory: int) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory), loaded=loaded)
    return llm


def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]
    outs = llm.generate(windows,
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    nll = count = 0
    for w, out in zip(windows, outs):
        for token, entry in zip(w[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            count += 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,fp16,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    args = ap.parse_args()
    loaded = load_model()
    ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    prompts = [loaded.tokenizer.encode(t) for t in REFERENCE_TEXTS]
    reference = None
    print(f"{'kv dtype':>9} {'tokens held':>12} {'perplexity':>11} {'greedy tokens = fp32':>22} {'prompts identical':>18}")
    for dtype in args.dtypes.split(","):
        llm = engine_llm(loaded, dtype, args.kv_cache_memory)
        held = llm.stats()["kv_total_blocks"] * llm.engine.config.kv.block_size
        ppl = perplexity(llm, ids, args.window)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                             use_tqdm=False)]
        reference = reference or outs
        same = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
        print(f"{dtype:>9} {held:>12,} {ppl:>11.3f} {sum(same):>10}/{len(prompts) * args.new_tokens:<11} "
              f"{sum(s == args.new_tokens for s in same):>9}/{len(prompts)}   ({len(ids)} text tokens)", flush=True)
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
