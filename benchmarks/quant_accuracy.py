"""What quantisation costs in accuracy, on the embedded SmolLM2-135M-Instruct:

  * perplexity on a fixed English text shipped with the tests (tests/data/apache-2.0.txt,
    the Apache-2.0 licence), in windows of --window tokens, each scored from its start
    (the first token of a window is context only);
  * greedy agreement with fp32 over the held-in reference prompts (tests/conftest.py):
    how many of the --new-tokens greedy tokens match fp32's before the first difference,
    and how many prompts give fp32's whole continuation.

Modes: none (fp32, the reference), q8_0 / q4_0 / q4_1 (quantised from fp32 at load),
gguf (the file's own blocks: Q4_1 layers, Q8_0 tied head), and bf16 / f16 (the fp32 model's
matrices rounded to BF16 / F16 in a rewritten GGUF, run as stored with fp32 arithmetic:
what a bf16 or f16 checkpoint costs against fp32). Native kernels.

    .venv/bin/python benchmarks/quant_accuracy.py [--modes none,q8_0,q4_0,q4_1,gguf,bf16,f16] [--model FILE.gguf]

(`--model`: another GGUF, e.g. a llama-quantize Q4_K_M file; none is then its blocks
inflated to fp32 and gguf its blocks with int8 activations.)
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import REFERENCE_TEXTS  # noqa: E402
from model_utils import greedy_generate, prefill_logits  # noqa: E402

from pagedserve.attention.selector import get_backend  # noqa: E402
from pagedserve.kernels import resolve_kernels  # noqa: E402
from pagedserve.model.gguf_rewrite import rewrite_gguf  # noqa: E402
from pagedserve.model.loader import LoadedModel, load_model  # noqa: E402
from pagedserve.model.sources import resolve_model  # noqa: E402

TEXT = ROOT / "tests" / "data" / "apache-2.0.txt"


def perplexity(model, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = prefill_logits(model, chunk, get_backend())
        nll += F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


HALF_MODES = {"bf16": GGMLQuantizationType.BF16, "f16": GGMLQuantizationType.F16}


def load_mode(model: str | None, mode: str, scratch: Path) -> LoadedModel:
    """The model as `mode` runs it: a half mode rewrites the file's matrices in that type
    (norms stay F32) and keeps them as stored."""
    if mode not in HALF_MODES:
        return load_model(model, quantization=mode)
    path = scratch / f"{mode}.gguf"
    rewrite_gguf(resolve_model(model).path, path, lambda name, shape, qtype: HALF_MODES[mode] if len(shape) == 2
                 else qtype)
    return load_model(path, use_cache=False, keep_blocks=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none,q8_0,q4_0,q4_1,gguf")
    ap.add_argument("--model", default=None, help="a .gguf; default: the embedded SmolLM2")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                    help="greedy agreement (against the first mode, which should be none)")
    args = ap.parse_args()
    kernels = resolve_kernels("native")
    reference: list[list[int]] | None = None
    print(f"{'mode':>6} {'perplexity':>11} {'greedy tokens = fp32':>22} {'prompts identical':>18}")
    scratch = tempfile.TemporaryDirectory()
    for mode in args.modes.split(","):
        loaded = load_mode(args.model, mode, Path(scratch.name))
        loaded.model.set_kernels(kernels)
        ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        ppl = perplexity(loaded.model, ids, args.window)
        if not args.greedy:
            print(f"{mode:>6} {ppl:>11.3f}   ({len(ids)} text tokens)")
            continue
        prompts = [loaded.tokenizer.encode(t) for t in REFERENCE_TEXTS]
        outs = [greedy_generate(loaded.model, p, args.new_tokens, get_backend()) for p in prompts]
        if reference is None:
            reference = outs
        same = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
        print(f"{mode:>6} {ppl:>11.3f} {sum(same):>10}/{len(prompts) * args.new_tokens:<11} "
              f"{sum(s == args.new_tokens for s in same):>9}/{len(prompts)}   ({len(ids)} text tokens)")


if __name__ == "__main__":
    main()
