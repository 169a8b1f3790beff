"""The automatic step budget, designed in the simulator before it is measured on the engine.

The workloads W1-W4 (`benchmarks/peers.py`, docs/benchmarks.md) through the calibrated twin of this CPU (`pagedserve sim calibrate` first),
each under the old fixed 256-token budget, absolute ITL targets and the automatic target at
several ratios (a step beside decodes within R x their predicted decode-only time): output
tok/s as a ratio to the fixed budget's, and p99 ITL.

    .venv/bin/python benchmarks/auto_budget_sim.py [--ratios 1.5,2,3] [--targets-ms 50]
"""
from __future__ import annotations

import argparse
import json

from pagedserve.core.scheduler_config import CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedserve.sim.scenario import build_scenario
from pagedserve.sim.simulator import simulate
from pagedserve.workload.datasets import mixed_dataset, random_dataset
from pagedserve.workload.serving_stats import summarize

VOCAB = 49_152
WORKLOADS = {  # name: (concurrency, requests)
    "W1": (1, lambda: random_dataset(8, 128, 128, vocab_size=VOCAB, seed=1)),
    "W2": (16, lambda: random_dataset(64, 128, 128, vocab_size=VOCAB, seed=2)),
    "W3": (64, lambda: random_dataset(128, 256, 128, vocab_size=VOCAB, seed=3)),
    "W4": (32, lambda: mixed_dataset(96, 64, 2000, 8, 64, vocab_size=VOCAB, seed=4)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratios", default="1.5,2,3")
    ap.add_argument("--targets-ms", default="50")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    fixed = build_scenario("smollm2-135m", "cpu-local", "fp32", max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS)
    variants = {"fixed256": {}}
    variants.update({f"target{t}ms": {"itl_target_ms": float(t)} for t in args.targets_ms.split(",") if t})
    variants.update({f"auto{r}": {"itl_ratio": float(r)} for r in args.ratios.split(",") if r})
    rows = []
    for name, (concurrency, make) in WORKLOADS.items():
        requests = make()
        base = None
        for variant, options in variants.items():
            result = simulate(requests, fixed.cost, fixed.sim_config("chunked", concurrency, **options))
            summary = summarize(result.records, result.duration, percentiles=(99,))
            tput = summary["output_throughput"]
            base = base or tput
            rows.append({"workload": name, "variant": variant, "output_tok_s": tput, "vs_fixed": tput / base,
                         "p99_itl_ms": summary["p99_itl_ms"], "mean_ttft_ms": summary["mean_ttft_ms"]})
            print(f"{name} {variant:>12}: {tput:8.1f} tok/s ({tput / base:.2f}x fixed)  "
                  f"p99 ITL {summary['p99_itl_ms']:7.1f} ms  mean TTFT {summary['mean_ttft_ms']:8.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
