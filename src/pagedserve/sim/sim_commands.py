"""argparse wiring for `pagedserve sim`, `pagedserve kv` and `pagedserve doctor`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

from ..engine_config import parse_memory
from ..core.scheduler_config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GPU_DEFAULT_MAX_NUM_SEQS,
    MIN_WHOLE_PROMPT_BUDGET,
    POLICIES,
    SCHEDULING_POLICIES,
)
from ..core.contiguous_kv import KV_LAYOUTS, PAGE_SIZE
from ..workload.datasets import add_dataset_args, dataset_from_args
from ..workload.serving_stats import CLASS_TTFT, summary_columns
from .cost_model import DTYPE_BYTES, DTYPES, GGUF_DTYPE
from .hardware import HARDWARE_NAMES
from .models import MODELS

# The row `sim` adds for --itl-target-ms / --ttft-target-ms: chunked prefill budgeted by the target.
TARGET_ROW = "chunked@target"

SUMMARY_COLUMNS = summary_columns(("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms",
                                   "goodput", "mean_kv_usage", "kv_waste", "num_preemptions"))


def _add_setup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", choices=HARDWARE_NAMES, default="h100-sxm5")
    p.add_argument("--model", default="llama-3.3-70b", help=f"{', '.join(MODELS)}, or a config.json / .gguf path")
    p.add_argument("--dtype", choices=(*DTYPES, GGUF_DTYPE), default=None,
                   help="weight dtype; gguf: a .gguf model's own types (Q4_K_M's mix...) at their bytes, "
                        "multiplied at the bf16 rate (default: gguf for a .gguf model, else bf16)")
    p.add_argument("--kv-cache-dtype", choices=DTYPES, default=None, help="default: as --dtype (bf16 for gguf)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--max-num-seqs", type=int, default=GPU_DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"chunked policy's token budget (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}); whole-prompt "
                        f"policies use max(max_model_len, {MIN_WHOLE_PROMPT_BUDGET})")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's, capped at the KV pool")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    p.add_argument("--kv-cache-memory", type=parse_memory, default=None, help="KV pool bytes, overriding the memory plan")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)


def add_sim_parser(sub) -> argparse.ArgumentParser:
    """`sim` and its subcommands; returns `sim cluster`'s parser (entrypoints/ adds --ray-config to it)."""
    p = sub.add_parser("sim", help="simulate the scheduler on a hardware/model cost model")
    _add_setup_args(p)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from " + ", ".join(POLICIES))
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--goodput-ttft-ms", type=float, default=2000.0)
    p.add_argument("--goodput-itl-ms", type=float, default=100.0)
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="add a 'chunked@target' row: each step's budget chosen to keep ITL under this")
    p.add_argument("--ttft-target-ms", type=float, default=None,
                   help="with no decode running, a step may take this long (default: up to the cap)")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default="paged",
                   help="contiguous: a demand-paged region per request, budgeted in pages (no prefix caching)")
    p.add_argument("--page-size", type=parse_memory, default=PAGE_SIZE,
                   help="the contiguous layout's commit unit (4 KiB CPU pages; CUDA's VMM maps 2 MiB)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="priority: requests' classes (--priority-every, jsonl 'priority') order the queue and preempt")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="DIR", help="write timeline and ITL PNGs here")
    add_dataset_args(p)
    p.set_defaults(func=cmd_sim)
    sim_sub = p.add_subparsers(dest="sim_command")
    cal = sim_sub.add_parser("calibrate", help="measure this CPU for --hardware cpu-local")
    cal.set_defaults(func=cmd_calibrate)
    twin = sim_sub.add_parser("twin", help="the real engine vs the simulator on a small workload")
    twin.add_argument("--num-prompts", type=int, default=24)
    twin.add_argument("--policies", default=",".join(POLICIES))
    twin.add_argument("--seed", type=int, default=0)
    twin.add_argument("--json", action="store_true")
    twin.set_defaults(func=cmd_twin)
    return add_cluster_parser(sim_sub)


def cmd_sim(args: argparse.Namespace) -> int:
    from ..workload.serving_stats import SLO
    from .scenario import build_scenario
    from .simulator import simulate

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(f"policies must be a comma-separated subset of {', '.join(POLICIES)}; got {args.policies!r}")
    args.dtype = args.dtype or (GGUF_DTYPE if args.model.endswith(".gguf") else "bf16")
    sc = build_scenario(args.model, args.hardware, args.dtype, args.kv_cache_dtype, args.tp, args.block_size,
                        args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len,
                        args.gpu_memory_utilization, args.kv_cache_memory, args.enable_prefix_caching)
    requests = dataset_from_args(args)
    slo = SLO(args.goodput_ttft_ms / 1e3, args.goodput_itl_ms / 1e3)
    results = {p: simulate(requests, sc.cost, sc.sim_config(p, args.concurrency, args.request_rate, args.seed,
                                                            kv_layout=args.kv_layout, page_size=args.page_size,
                                                            scheduling_policy=args.scheduling_policy))
               for p in policies}
    budgets = {p: sc.budget(p) for p in policies}
    if args.itl_target_ms is not None or args.ttft_target_ms is not None:
        results[TARGET_ROW] = simulate(requests, sc.cost, sc.sim_config(
            "chunked", args.concurrency, args.request_rate, args.seed, args.itl_target_ms, args.ttft_target_ms,
            args.kv_layout, args.page_size, scheduling_policy=args.scheduling_policy))
        budgets[TARGET_ROW] = f"itl {args.itl_target_ms} ms, ttft {args.ttft_target_ms} ms, cap {sc.target_cap()}"
    summaries = {p: r.summary(slo) for p, r in results.items()}
    plan = sc.plan
    setup = {
        "hardware": args.hardware, "model": args.model, "dtype": args.dtype,
        "kv_cache_dtype": sc.cost.kv_dtype, "tp": args.tp, "num_blocks": plan.num_blocks,
        "kv_pool_gib": plan.kv_pool_bytes / 2**30, "weights_gib": plan.weight_bytes / 2**30,
        "kv_pool_tokens": plan.num_tokens, "max_model_len": sc.max_model_len,
        "budgets": budgets, "concurrency": args.concurrency, "kv_layout": args.kv_layout,
        "dataset": args.dataset_name, "num_prompts": len(requests),
    }
    if args.plot:
        from .plot import write_plots

        setup["plots"] = [str(x) for x in write_plots(results, args.plot)]
    if args.json:
        print(json.dumps({"setup": setup, "results": summaries}, indent=2))
        return 0
    print(f"{args.model} ({args.dtype} weights, {sc.cost.kv_dtype} KV, tp={args.tp}) on {args.hardware}: "
          f"weights {plan.weight_bytes / 2**30:.1f} GiB/GPU, KV pool {plan.kv_pool_bytes / 2**30:.2f} GiB = "
          f"{plan.num_blocks:,} blocks x {plan.block_size} = {plan.num_tokens:,} tokens; max_model_len {sc.max_model_len:,}"
          + (f"; contiguous layout, {args.page_size:,} B pages, no prefix caching" if args.kv_layout == "contiguous" else ""))
    print(f"workload: {args.dataset_name}, {len(requests)} requests, concurrency {args.concurrency or 'unlimited'}, "
          f"rate {args.request_rate}/s; budgets {setup['budgets']}")
    header = f"{'policy':<15}" + "".join(f"{name:>15}" for name, _, _ in SUMMARY_COLUMNS)
    print(header)
    for p, s in summaries.items():
        print(f"{p:<15}" + "".join(f"{fmt.format(s[key]):>15}" for _, key, fmt in SUMMARY_COLUMNS))
        classes = [f"{k.removeprefix(CLASS_TTFT)}: {v:,.0f} ms" for k, v in s.items() if k.startswith(CLASS_TTFT)]
        if classes:
            print(f"{'':<15}p99 TTFT by priority ({args.scheduling_policy}): " + ", ".join(classes))
    if args.plot:
        print("plots:", ", ".join(setup["plots"]))
    return 0


# `sim cluster`'s flags for the instances' engines and layouts, and their defaults. They
# parse as None, so that `--ray-config` (whose YAML sets them) can tell one was given.
CLUSTER_ENGINE_DEFAULTS = {"model": "llama-3.1-8b", "dtype": "bf16", "kv_cache_dtype": None,
                           "layouts": "4r,2r:tp2,2p2d,1p3d,3p1d", "max_num_seqs": GPU_DEFAULT_MAX_NUM_SEQS,
                           "max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS, "max_model_len": None}


def add_cluster_parser(sim_sub) -> argparse.ArgumentParser:
    from .cluster import KV_LINKS

    d = CLUSTER_ENGINE_DEFAULTS
    p = sim_sub.add_parser("cluster", help="colocated replicas vs disaggregated prefill/decode vs TP, on one clock")
    p.add_argument("--hardware", choices=HARDWARE_NAMES, default="h100-sxm5")
    p.add_argument("--model", help=f"{', '.join(MODELS)}, or a config.json / .gguf path (default {d['model']})")
    p.add_argument("--dtype", choices=DTYPES, help=f"weight dtype (default {d['dtype']})")
    p.add_argument("--kv-cache-dtype", choices=DTYPES, help="default: as --dtype")
    p.add_argument("--layouts", help="comma-separated: Nr (N colocated replicas), xPyD (x prefill, y decode "
                                     f"instances), each with an optional :tpN (default {d['layouts']})")
    p.add_argument("--link", choices=list(KV_LINKS), default="rdma-100", help="what KV transfers cross")
    p.add_argument("--max-num-seqs", type=int, help=f"default {d['max_num_seqs']}")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help=f"each instance's chunked budget (default {d['max_num_batched_tokens']})")
    p.add_argument("--max-model-len", type=int, help="default: the model's, capped at the KV pool")
    p.add_argument("--request-rate", type=float, default=None,
                   help="simulate at this Poisson rate; default: search each layout's goodput")
    p.add_argument("--slo-ttft-ms", type=float, default=250.0)
    p.add_argument("--slo-itl-ms", type=float, default=10.0, help="per-request mean time per output token")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="goodput: the highest rate at which this share of requests meets both SLOs")
    p.add_argument("--search-iterations", type=int, default=7)
    p.add_argument("--max-rate", type=float, default=512.0, help="the goodput search's upper end, req/s")
    p.add_argument("--json", action="store_true")
    add_dataset_args(p)
    p.set_defaults(func=cmd_cluster)
    return p


def cmd_cluster(args: argparse.Namespace) -> int:
    from ..workload.serving_stats import SLO
    from .cluster import ClusterSetup, Layout, max_goodput, simulate_cluster

    for name, default in CLUSTER_ENGINE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    layouts = [Layout.parse(x) for x in args.layouts.split(",") if x.strip()]
    if not layouts:
        raise ValueError("layouts must name at least one layout")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {args.attainment}")
    setup = ClusterSetup(args.model, args.hardware, args.dtype, args.kv_cache_dtype, args.max_num_seqs,
                         args.max_num_batched_tokens, args.max_model_len, args.link, args.seed)
    requests = dataset_from_args(args)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    rows = []
    for layout in layouts:
        if args.request_rate is None:
            rate = max_goodput(requests, layout, setup, slo, args.attainment, hi=args.max_rate,
                              iterations=args.search_iterations)
        else:
            rate = args.request_rate
        s = simulate_cluster(requests, layout, setup, rate).summary(slo) if rate > 0 else {}
        rows.append({"layout": layout.name, "num_gpus": layout.num_gpus, "rate": rate, **s})
    if args.json:
        print(json.dumps({"setup": dataclasses.asdict(setup), "rows": rows}, indent=2))
        return 0
    what = "goodput (req/s at >= {:.0%} SLO attainment)".format(args.attainment) if args.request_rate is None \
        else f"rate {args.request_rate} req/s"
    print(f"{args.model} on {args.hardware}, KV over {args.link}; SLO TTFT {args.slo_ttft_ms:g} ms, "
          f"TPOT {args.slo_itl_ms:g} ms; {args.dataset_name}, {len(requests)} requests; {what}")
    print(f"{'layout':<10}{'GPUs':>5}{'req/s':>9}{'per GPU':>9}{'attain':>8}{'mean TTFT':>11}{'p90 TTFT':>10}"
          f"{'mean TPOT':>11}{'KV GiB':>8}")
    for r in rows:
        if "slo_attainment" not in r:
            print(f"{r['layout']:<10}{r['num_gpus']:>5}{0.0:>9.2f}{0.0:>9.2f}   (misses the SLO at any rate)")
            continue
        print(f"{r['layout']:<10}{r['num_gpus']:>5}{r['rate']:>9.2f}{r['rate'] / r['num_gpus']:>9.2f}"
              f"{r['slo_attainment']:>8.2f}{r['mean_ttft_ms']:>11.1f}{r['p90_ttft_ms']:>10.1f}"
              f"{r['mean_tpot_ms']:>11.2f}{r['kv_transfer_gib']:>8.1f}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .twin import calibrate

    cal, path, points = calibrate()
    r = cal.rates
    print(f"{cal.model}, fp32, {cal.num_threads} threads; peak matmul (2048^3) {cal.matmul_flops / 1e9:.1f} GFLOP/s")
    print("rows              " + "".join(f"{m:>8}" for m, _ in r.linear))
    print("linear GFLOP/s    " + "".join(f"{f / 1e9:>8.1f}" for _, f in r.linear))
    print("LM head GFLOP/s   " + "".join(f"{f / 1e9:>8.1f}" for _, f in r.head))
    print(f"attention: {r.attention_call_s * 1e6:.0f} us per layer call, K/V reads {r.kv_bandwidth / 1e9:.2f} GB/s, "
          f"{r.attention_flops / 1e9:.1f} GFLOP/s")
    print(f"step overhead outside those: {cal.step_overhead_s * 1e3:.2f} ms + {r.overhead_per_token_s * 1e6:.1f} us "
          f"per token (from " + ", ".join(f"{t} tok: {s * 1e3:.1f} ms" for t, s in points) + ")")
    spread = cal.step_spread
    q = lambda p: spread[min(len(spread) - 1, int(p * len(spread)))]  # noqa: E731
    print(f"step spread ({len(spread)} identical decode steps, time / mean): p50 {q(0.5):.2f}, p90 {q(0.9):.2f}, "
          f"p99 {q(0.99):.2f}, max {spread[-1]:.2f}")
    print(f"-> {path}")
    return 0


def cmd_twin(args: argparse.Namespace) -> int:
    from .twin import twin

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rows = twin(args.num_prompts, policies, args.seed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'policy':<11}{'engine tok/s':>14}{'sim tok/s':>12}{'sim/engine':>12}{'engine s':>10}{'sim s':>8}")
    for r in rows:
        print(f"{r['policy']:<11}{r['engine_output_throughput']:>14.1f}{r['sim_output_throughput']:>12.1f}"
              f"{r['ratio']:>12.2f}{r['engine_duration_s']:>10.2f}{r['sim_duration_s']:>8.2f}")
    return 0


def add_kv_parser(sub) -> None:
    p = sub.add_parser("kv", help="KV-cache sizing and fragmentation arithmetic")
    kv_sub = p.add_subparsers(dest="kv_command", required=True)
    size = kv_sub.add_parser("size", help="KV bytes per token / sequence, and what a memory budget holds")
    size.add_argument("--model", default=None, help=f"{', '.join(MODELS)}, or a config.json / .gguf path")
    size.add_argument("--layers", type=int, default=None, help="KV-bearing (full-attention) layers; overrides --model")
    size.add_argument("--kv-heads", type=int, default=None)
    size.add_argument("--head-dim", type=int, default=None)
    size.add_argument("--dtype", choices=DTYPES, default="bf16")
    size.add_argument("--tokens", type=int, default=8192)
    size.add_argument("--memory", type=parse_memory, default=None, help="bytes, e.g. 40GiB")
    size.add_argument("--json", action="store_true")
    size.set_defaults(func=cmd_kv_size)
    w = kv_sub.add_parser("waste", help="contiguous reservation vs paged blocks")
    w.add_argument("--requests", type=int, default=1000)
    w.add_argument("--mean", type=float, default=1500)
    w.add_argument("--std", type=float, default=600)
    w.add_argument("--max-len", type=int, default=8192)
    w.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--stream-bytes", type=int, default=768,
                   help="one token of one layer's K: kv_heads x head_dim x dtype bytes (768: SmolLM2, fp32)")
    w.add_argument("--page-size", type=parse_memory, default=PAGE_SIZE, help="the demand-paged commit unit")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_kv_waste)


def cmd_kv_size(args: argparse.Namespace) -> int:
    from .kv_calc import kv_size
    from .models import load_model

    m = load_model(args.model) if args.model else None
    layers = args.layers or (m.num_layers if m else None)
    heads = args.kv_heads or (m.num_kv_heads if m else None)
    head_dim = args.head_dim or (m.head_dim if m else None)
    if None in (layers, heads, head_dim):
        raise ValueError("model is required unless --layers, --kv-heads and --head-dim are all given")
    r = kv_size(layers, heads, head_dim, DTYPE_BYTES[args.dtype], args.tokens, args.memory)
    print(json.dumps(r.to_dict(), indent=2) if args.json else r.explain())
    return 0


def cmd_kv_waste(args: argparse.Namespace) -> int:
    from .kv_calc import waste

    r = waste(args.requests, args.mean, args.std, args.max_len, args.block_size, args.seed, args.stream_bytes,
              args.page_size)
    print(json.dumps(r.to_dict(), indent=2) if args.json else r.explain())
    return 0


def add_doctor_parser(sub) -> None:
    from .doctor import ServeConfig

    p = sub.add_parser("doctor", help="diagnose a serving configuration")
    p.add_argument("--config", help="a JSON (or YAML, with PyYAML) file of serve flags; flags given here win")
    d = ServeConfig()
    p.add_argument("--model", help=f"default {d.model}")
    p.add_argument("--hardware", choices=HARDWARE_NAMES)
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--kv-cache-dtype", choices=DTYPES)
    p.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int)
    p.add_argument("--pipeline-parallel-size", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--speculative-config", help='JSON, e.g. {"method": "eagle3", "num_speculative_tokens": 3}')
    p.add_argument("--vllm-version", help="check the speculative options against this version")
    p.add_argument("--itl-target-ms", type=float, help="p99 ITL to meet (objective); states the step budget it implies")
    p.add_argument("--ttft-target-ms", type=float, help="p99 TTFT to meet (objective; with priority classes, the "
                                                        "most urgent class's)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   help="with a workload of priority classes (--priority-every, or a jsonl's 'priority'), doctor "
                        "checks the most urgent class's TTFT under it")
    p.add_argument("--objective", choices=("throughput", "itl"), default="throughput",
                   help="maximise output throughput, or minimise p99 ITL, subject to the targets")
    p.add_argument("--min-throughput", type=float, help="objective itl: output tok/s floor")
    p.add_argument("--simulate", action="store_true",
                   help="simulate each fix on a workload that exercises it; recommend only what wins")
    p.add_argument("--tune", action="store_true",
                   help="search the scheduler configuration for the workload (--dataset-name ...) and objective")
    p.add_argument("--max-evals", type=int, default=40, help="--tune: most configurations simulated")
    p.add_argument("--concurrency", type=int, default=None, help="--simulate/--tune: requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="--tune: Poisson arrivals per second")
    p.add_argument("--json", action="store_true")
    add_dataset_args(p)
    # The tuner simulates tens of configurations: a smaller default workload than sim's.
    p.set_defaults(func=cmd_doctor, num_prompts=128)


DOCTOR_KEYS = ("model", "hardware", "dtype", "kv_cache_dtype", "tensor_parallel_size", "pipeline_parallel_size",
               "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization",
               "enable_chunked_prefill", "enable_prefix_caching", "speculative_config", "vllm_version", "itl_target_ms",
               "ttft_target_ms", "scheduling_policy")


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import Objective, ServeConfig, diagnose, diagnose_priorities, load_config_file, quantify

    values = load_config_file(args.config) if args.config else {}
    values.update({k: getattr(args, k) for k in DOCTOR_KEYS if getattr(args, k) is not None})
    cfg = ServeConfig.from_mapping(values)
    objective = Objective(args.objective, cfg.itl_target_ms, cfg.ttft_target_ms, args.min_throughput)
    if args.tune:
        return _doctor_tune(args, cfg, objective)
    findings = diagnose(cfg)
    if args.priority_every is not None or args.dataset_name == "jsonl":  # a workload that may carry classes
        findings += diagnose_priorities(cfg, dataset_from_args(args), args.concurrency, args.request_rate, args.seed)
    if args.simulate:
        findings = quantify(cfg, findings, args.concurrency, objective, args.seed)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
        return 0
    if not findings:
        print("no findings: the configuration is consistent")
    if args.simulate:
        print(f"objective: {objective.describe()}; findings ordered by simulated impact")
    for f in findings:
        print(f"[{f.severity.upper()}] {f.id}: {f.message}\n    fix: {f.fix}")
        if f.impact:
            print(f"    simulated on {f.impact['workload']}:")
            for label, key in (("before", "before"), ("after ", "after")):
                print(f"      {label} {_impact_row(f.impact[key])}")
    return 0


def _impact_row(m: dict) -> str:
    if "error" in m:
        return f"cannot run: {m['error']}"
    row = (f"{m['output_throughput']:>10,.1f} tok/s  p99 ITL {m['p99_itl_ms']:>9,.1f} ms  "
           f"p99 TTFT {m['p99_ttft_ms']:>11,.0f} ms  preemptions {m['num_preemptions']:>5,}")
    row += f"  urgent class p99 TTFT {m['p99_ttft_high_ms']:,.0f} ms" if "p99_ttft_high_ms" in m else ""
    return row + (f"  refused {m['rejected']}" if m.get("rejected") else "")


def _doctor_tune(args: argparse.Namespace, cfg, objective) -> int:
    from .tune import tune

    result = tune(cfg, dataset_from_args(args), objective, args.concurrency, args.request_rate, args.seed,
                  args.max_evals)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(result.explain())
    return 0
