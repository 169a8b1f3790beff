"""`pagedserve bench serve` and `pagedserve bench compare`: parsers here, work in serve.py / compare.py
(imported lazily, so the other subcommands start without aiohttp or torch)."""
from __future__ import annotations

import argparse
import gc
import json
import math

from ..core.scheduler_config import POLICIES
from ..workload.datasets import add_dataset_args, dataset_from_args


def _percentiles(value: str) -> list[float]:
    qs = [float(x) for x in value.split(",") if x.strip()]
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError(f"percentiles must be comma-separated numbers in [0, 100], got {value!r}")
    return qs


def _names(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in allowed]
    if bad:
        raise ValueError(f"{what} must be a comma-separated subset of {', '.join(allowed)}; got {value!r}")
    return names


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: an HTTP load generator and the offline scheduler study")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    s = bsub.add_parser("serve", help="load-test any OpenAI-compatible server (streaming)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    s.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    s.add_argument("--tokenizer", default=None, help="a .gguf to turn token ids into chat text; default: the embedded model")
    s.add_argument("--request-rate", type=float, default=math.inf, help="req/s (Poisson/gamma arrivals); inf = all at once")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLO targets, KEY in ttft, tpot, e2el")
    s.add_argument("--percentiles", type=_percentiles, default=[50.0, 99.0])
    s.add_argument("--out", help="write the summary and every request's record as JSON here, with the commit, "
                                 "the CPU and --server-flags")
    s.add_argument("--server-flags", default=None,
                   help="how the server under test was started (e.g. 'pagedserve serve --quantization gguf'), "
                        "recorded in --out")
    s.add_argument("--no-progress", action="store_true")
    add_dataset_args(s)
    s.set_defaults(func=cmd_bench_serve)

    c = bsub.add_parser("compare", help="run one workload through each scheduler policy on the real model")
    c.add_argument("--policies", default=",".join(("naive", "static", "continuous", "chunked")))
    c.add_argument("--baselines", default="", help="comma-separated: hf (transformers generate(), one at a time), "
                   "hf-static (transformers, left-padded batches of up to --max-concurrency)")
    c.add_argument("--max-concurrency", type=int, default=None)
    c.add_argument("--serial-prompts", type=int, default=None, metavar="N",
                   help="naive and hf (one request at a time) run only the first N requests: same throughput "
                        "and ITL, far less time; their TTFT then counts a shorter queue")
    c.add_argument("--request-rate", type=float, default=math.inf)
    c.add_argument("--itl-target-ms", type=float, default=None,
                   help="also run chunked under this latency target (a row named chunked+target)")
    c.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    c.add_argument("--n", type=int, default=1, help="samples per request (parallel sampling fan-out)")
    c.add_argument("--kv-cache-memory", default=None, help="e.g. 512MiB; default: the engine's")
    c.add_argument("--max-num-seqs", type=int, default=128)
    c.add_argument("--out", help="write {setup, results} as JSON here")
    c.add_argument("--plot", metavar="DIR", help="write itl.png, timeline.png, ttft.png here")
    add_dataset_args(c)
    c.set_defaults(func=cmd_bench_compare)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from . import serve

    cfg = serve.ServeConfig(args.base_url, args.endpoint, args.model, args.request_rate, args.burstiness,
                            args.max_concurrency, args.ignore_eos, args.seed)
    slo = serve.parse_goodput(args.goodput)
    requests = dataset_from_args(args)
    texts = None
    if args.endpoint == "/v1/chat/completions":
        from ..model.registry import default_model_path
        from ..model.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(args.tokenizer or default_model_path())
        texts = [tok.decode(r.prompt_token_ids, skip_special_tokens=True) for r in requests]
    before = asyncio.run(serve.spec_decode_counters(cfg.base_url))
    outcomes, duration, peak = asyncio.run(serve.run(cfg, requests, texts, use_tqdm=not args.no_progress))
    spec = serve.spec_decode_delta(before, asyncio.run(serve.spec_decode_counters(cfg.base_url)))
    s = serve.summary(outcomes, duration, peak, slo, args.percentiles, spec)
    print(serve.format_summary(s, args.percentiles))
    failed = [o.error for o in outcomes if not o.success]
    if failed:
        print(f"first error: {failed[0]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(serve.result_json(cfg, s, outcomes, args.server_flags), f, indent=1)
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from ..engine_config import parse_memory
    from ..model.loader import load_model
    from ..model.registry import default_model_path
    from . import compare
    from .report import format_table, write_plots

    policies = _names(args.policies, POLICIES, "policies")
    baselines = _names(args.baselines, compare.BASELINES, "baselines")
    # (row name, policy, extra engine options)
    engine_runs = [(p, p, {}) for p in policies]
    if args.itl_target_ms is not None:
        engine_runs.append(("chunked+target", "chunked", {"itl_target_ms": args.itl_target_ms}))
    if not engine_runs and not baselines:
        raise ValueError("policies and baselines are both empty")
    if args.n < 1:
        raise ValueError(f"n must be >= 1, got {args.n}")
    if args.serial_prompts is not None and args.serial_prompts < 1:
        raise ValueError(f"serial_prompts must be >= 1, got {args.serial_prompts}")
    requests = dataset_from_args(args)
    # naive and hf serve one request at a time: their throughput and ITL do not depend on how
    # many requests wait behind, so on a slow machine they may run only the first ones.
    serial = requests[:args.serial_prompts]
    options = {"enable_prefix_caching": args.prefix_caching == "on", "max_num_seqs": args.max_num_seqs}
    if args.kv_cache_memory:
        options["kv_cache_memory"] = parse_memory(args.kv_cache_memory)
    setup = {"dataset": args.dataset_name, "num_prompts": len(requests), "n": args.n,
             "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
             "prefix_caching": args.prefix_caching, "serial_prompts": len(serial), "itl_target_ms": args.itl_target_ms}
    runs = {}

    def write_json(summaries: dict) -> None:
        ratio = compare.ratios(summaries, "naive") if "naive" in summaries else None
        with open(args.out, "w") as f:
            json.dump({"setup": setup, "results": summaries, "ratio_to_naive": ratio}, f, indent=1)

    def finished(name: str) -> None:
        print(f"{name}: {runs[name].duration:.1f} s", flush=True)
        if args.out:  # after every run, so a long study keeps what it has finished
            write_json({n: r.summary() for n, r in runs.items()})

    if engine_runs:
        loaded = load_model()
        for name, p, extra in engine_runs:
            runs[name] = compare.run_engine(loaded, p, serial if p == "naive" else requests,
                                            max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                                            n=args.n, seed=args.seed, **options, **extra)
            finished(name)
            gc.collect()  # the finished engine's KV pool, before the next one allocates its own
    if baselines:
        hf_model = compare.load_hf_model(default_model_path())
        for b in baselines:
            if b == "hf":
                runs[b] = compare.run_hf(hf_model, serial, args.request_rate, args.seed)
            else:
                runs[b] = compare.run_hf_static(hf_model, requests, args.max_concurrency, args.request_rate, args.seed)
            finished(b)
    summaries = {name: r.summary() for name, r in runs.items()}
    ratio = compare.ratios(summaries, "naive") if "naive" in summaries else None
    print(f"workload: {args.dataset_name}, {len(requests)} requests, prompts {min(r.prompt_len for r in requests)}-"
          f"{max(r.prompt_len for r in requests)} tokens, outputs {min(r.output_len for r in requests)}-"
          f"{max(r.output_len for r in requests)}, n={args.n}, concurrency {args.max_concurrency or 'unlimited'}, "
          f"rate {args.request_rate}/s, prefix caching {args.prefix_caching}"
          + (f"; naive and hf: the first {len(serial)} requests" if len(serial) < len(requests) else ""))
    print(format_table(summaries, ratio))
    if "chunked" in summaries:
        pairs = [f"chunked/{b} {compare.ratios(summaries, b)['chunked']:.2f}x"
                 for b in ("naive", "static", "hf", "hf-static") if b in summaries]
        print("output throughput:", ", ".join(pairs))
    if args.plot:
        setup["plots"] = [str(p) for p in write_plots(runs, args.plot)]
        print("plots:", ", ".join(setup["plots"]))
    if args.out:
        write_json(summaries)
    return 0
