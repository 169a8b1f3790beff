"""Synthetic and file-based workloads as token-id requests, deterministic by seed.

Every generator returns a list of BenchRequest. Token ids are drawn uniformly from
[FIRST_TOKEN_ID, vocab_size) so they never collide with the low special ids; a
tokenizer can turn them into text later. `add_dataset_args` / `dataset_from_args`
give `sim` and `bench` the exact same options.

sharegpt-like: lengths are log-normal with the means the PagedAttention paper
reports for ShareGPT (Kwon et al., SOSP 2023, Fig. 11: mean input 161.31 tokens,
mean output 337.99 tokens). The paper gives no spread, so the log-normal sigmas
(SHAREGPT_INPUT_SIGMA, SHAREGPT_OUTPUT_SIGMA) are our assumption, chosen so that a
few percent of conversations exceed 1,000 tokens, as its histogram's long tail shows.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from ..core.validation import is_int, require_int

DATASETS = ("random", "mixed", "shared-prefix", "sharegpt-like", "jsonl")
FIRST_TOKEN_ID = 10
SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.8


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    # Seconds after the start of the run; None = decided by the arrival process.
    arrival_time: float | None = None
    # Lower runs first under --scheduling-policy priority (as the server's `priority` field).
    priority: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_ratio(range_ratio: float) -> None:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio!r}")


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [FIRST_TOKEN_ID + int(x * (vocab_size - FIRST_TOKEN_ID)) for x in (rng.random() for _ in range(n))]


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean * (1 - r), mean * (1 + r)], as vLLM bench's --random-range-ratio."""
    lo = max(1, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   vocab_size: int = 32_000, seed: int = 0,
                   output_range_ratio: float | None = None) -> list[BenchRequest]:
    """output_range_ratio, when given, spreads output lengths differently from prompt lengths."""
    for name, v in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        require_int(name, v, 1)
    _check_ratio(range_ratio)
    out_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    _check_ratio(out_ratio)
    rng = random.Random(seed)
    return [BenchRequest(_tokens(rng, _length(rng, input_len, range_ratio), vocab_size),
                         _length(rng, output_len, out_ratio)) for _ in range(num_prompts)]


def mixed_dataset(num_prompts: int, short_input_len: int, long_input_len: int, long_every: int,
                  output_len: int, range_ratio: float = 0.0, vocab_size: int = 32_000,
                  seed: int = 0) -> list[BenchRequest]:
    """Mostly short prompts; every `long_every`-th request (1-based) is long: the chunked-prefill stress case."""
    for name, v in (("num_prompts", num_prompts), ("short_input_len", short_input_len),
                    ("long_input_len", long_input_len), ("long_every", long_every), ("output_len", output_len)):
        require_int(name, v, 1)
    _check_ratio(range_ratio)
    rng = random.Random(seed)
    out = []
    for i in range(1, num_prompts + 1):
        mean = long_input_len if i % long_every == 0 else short_input_len
        out.append(BenchRequest(_tokens(rng, _length(rng, mean, range_ratio), vocab_size),
                                _length(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int,
                          output_len: int, range_ratio: float = 0.0, vocab_size: int = 32_000,
                          seed: int = 0) -> list[BenchRequest]:
    """Request i belongs to group i % num_groups; a group shares its whole system prompt."""
    for name, v in (("num_prompts", num_prompts), ("num_groups", num_groups), ("prefix_len", prefix_len),
                    ("suffix_len", suffix_len), ("output_len", output_len)):
        require_int(name, v, 1)
    _check_ratio(range_ratio)
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    return [BenchRequest(prefixes[i % num_groups] + _tokens(rng, _length(rng, suffix_len, range_ratio), vocab_size),
                         _length(rng, output_len, range_ratio)) for i in range(num_prompts)]


def _lognormal_length(rng: random.Random, mean: float, sigma: float, max_len: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return max(4, min(max_len, round(rng.lognormvariate(mu, sigma))))


def sharegpt_like_dataset(num_prompts: int, max_len: int = 4096, vocab_size: int = 32_000,
                          seed: int = 0) -> list[BenchRequest]:
    """Long-tailed chat lengths (see the module docstring for the numbers); each length capped at max_len."""
    require_int("num_prompts", num_prompts, 1)
    require_int("max_len", max_len, 1)
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = _lognormal_length(rng, SHAREGPT_MEAN_INPUT, SHAREGPT_INPUT_SIGMA, max_len)
        n_out = _lognormal_length(rng, SHAREGPT_MEAN_OUTPUT, SHAREGPT_OUTPUT_SIGMA, max_len)
        out.append(BenchRequest(_tokens(rng, n_in, vocab_size), n_out))
    return out


def jsonl_dataset(path: str | Path, vocab_size: int = 32_000, seed: int = 0,
                  num_prompts: int | None = None) -> list[BenchRequest]:
    """One JSON object per line: {"prompt_token_ids": [...] | "prompt_len": N, "output_len": M,
    optional "arrival_time": seconds, optional "priority": an integer, lower first}."""
    rng = random.Random(seed)
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            where = f"{path}:{lineno}"
            if "prompt_token_ids" in obj:
                ids = [int(t) for t in obj["prompt_token_ids"]]
                if not ids:
                    raise ValueError(f"{where}: prompt_token_ids must not be empty")
            elif "prompt_len" in obj:
                require_int(f"{where}: prompt_len", obj["prompt_len"], 1)
                ids = _tokens(rng, obj["prompt_len"], vocab_size)
            else:
                raise ValueError(f"{where}: needs prompt_token_ids or prompt_len")
            require_int(f"{where}: output_len", obj.get("output_len"), 1)
            arrival = obj.get("arrival_time")
            if not is_int(obj.get("priority", 0)):
                raise ValueError(f"{where}: priority must be an integer, got {obj['priority']!r}")
            out.append(BenchRequest(ids, obj["output_len"], None if arrival is None else float(arrival),
                                    obj.get("priority", 0)))
            if num_prompts is not None and len(out) == num_prompts:
                break
    if not out:
        raise ValueError(f"dataset_path {path} holds no requests")
    return out


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASETS, default="mixed")
    g.add_argument("--dataset-path", help="jsonl file for --dataset-name jsonl")
    g.add_argument("--num-prompts", type=int, default=512)
    g.add_argument("--input-len", type=int, default=1024, help="random: mean prompt length")
    g.add_argument("--output-len", type=int, default=256, help="random/mixed/shared-prefix: mean output length")
    g.add_argument("--range-ratio", type=float, default=0.5,
                   help="lengths uniform in [mean*(1-r), mean*(1+r)]")
    g.add_argument("--output-range-ratio", type=float, default=None,
                   help="random: the output lengths' r, when it differs from --range-ratio")
    g.add_argument("--short-input-len", type=int, default=256, help="mixed: mean short prompt length")
    g.add_argument("--long-input-len", type=int, default=8192, help="mixed: mean long prompt length")
    g.add_argument("--long-every", type=int, default=32, help="mixed: every k-th request is long")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups sharing a system prompt")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt length")
    g.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: mean per-request suffix length")
    g.add_argument("--max-len", type=int, default=4096, help="sharegpt-like: cap on any one length")
    g.add_argument("--vocab-size", type=int, default=32_000, help="token ids are drawn below this")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--priority-every", type=int, default=None,
                   help="every k-th request (1-based) is urgent (priority 0), the others priority 1; "
                        "default: one class (jsonl may carry its own)")


def dataset_from_args(args: argparse.Namespace) -> list[BenchRequest]:
    requests = _dataset(args)
    every = getattr(args, "priority_every", None)
    return requests if every is None else with_priority_classes(requests, every)


def with_priority_classes(requests: list[BenchRequest], every: int) -> list[BenchRequest]:
    """Every `every`-th request (1-based) urgent (priority 0), the others priority 1."""
    require_int("priority_every", every, 1)
    for i, r in enumerate(requests, 1):
        r.priority = 0 if i % every == 0 else 1
    return requests


def _dataset(args: argparse.Namespace) -> list[BenchRequest]:
    name = args.dataset_name
    common = {"vocab_size": args.vocab_size, "seed": args.seed}
    if name == "random":
        return random_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio, **common,
                              output_range_ratio=getattr(args, "output_range_ratio", None))
    if name == "mixed":
        return mixed_dataset(args.num_prompts, args.short_input_len, args.long_input_len, args.long_every,
                             args.output_len, args.range_ratio, **common)
    if name == "shared-prefix":
        return shared_prefix_dataset(args.num_prompts, args.num_groups, args.prefix_len, args.suffix_len,
                                     args.output_len, args.range_ratio, **common)
    if name == "sharegpt-like":
        return sharegpt_like_dataset(args.num_prompts, args.max_len, **common)
    if not args.dataset_path:
        raise ValueError("dataset_path is required with --dataset-name jsonl")
    return jsonl_dataset(args.dataset_path, num_prompts=args.num_prompts, **common)
