"""`pagedserve sim cluster --ray-config CONFIG.yaml`: what the cluster simulator predicts
for the Ray Serve app that `pagedserve serve-ray CONFIG.yaml` runs (settings.predict), on
the workload `sim cluster`'s flags choose. The flag is added here, not in sim/sim_commands.py,
because it reads the app's settings and sim/ sits below entrypoints/. Nothing here, nor
in what it loads, imports ray: the prediction needs no Ray."""
from __future__ import annotations

import argparse
import dataclasses
import json

from ...sim.sim_commands import CLUSTER_ENGINE_DEFAULTS, cmd_cluster
from ...workload.datasets import dataset_from_args

# What the replicas run when the YAML names no engine.model: the engine's embedded SmolLM2-135M.
DEFAULT_MODEL = "smollm2-135m"
COLUMNS = (("replica", "replica", "{}"), ("requests", "requests", "{}"), ("hit rate", "hit_rate", "{:.3f}"),
           ("out tok/s", "output_throughput", "{:.1f}"), ("mean TTFT", "mean_ttft_ms", "{:.1f}"),
           ("p90 TTFT", "p90_ttft_ms", "{:.1f}"), ("mean TPOT", "mean_tpot_ms", "{:.2f}"))


def add_ray_config_arg(cluster: argparse.ArgumentParser) -> None:
    """Give `sim cluster` (its parser) the --ray-config flag and route the command here."""
    cluster.add_argument(
        "--ray-config", metavar="CONFIG.yaml",
        help="predict the Ray Serve app of this YAML file (as `pagedserve serve-ray` takes it): its replicas, "
             "router policy and engine options, on --hardware and the workload flags at --request-rate; "
             "--model defaults to the YAML's engine.model (else smollm2-135m)")
    cluster.set_defaults(func=cmd_sim_cluster)


def cmd_sim_cluster(args: argparse.Namespace) -> int:
    return cmd_cluster(args) if args.ray_config is None else cmd_predict(args)


def cmd_predict(args: argparse.Namespace) -> int:
    from .settings import RayServeConfig, cluster_setup, predict

    given = [f"--{name.replace('_', '-')}" for name in CLUSTER_ENGINE_DEFAULTS
             if name != "model" and getattr(args, name) is not None]
    if given:
        raise ValueError(f"--ray-config takes the replicas and their engine options from {args.ray_config}; "
                         f"drop {', '.join(given)} (or set them in its engine/replicas sections)")
    if args.request_rate is None:
        raise ValueError("--ray-config needs --request-rate (requests/s; inf: all at once): the prediction is "
                         "one run at that rate, not a goodput search")
    config = RayServeConfig.load(args.ray_config)
    model = args.model or config.server.engine.model or DEFAULT_MODEL
    requests = dataset_from_args(args)
    rows = predict(config, requests, model, args.hardware, args.request_rate, args.seed)
    setup = cluster_setup(config, model, args.hardware, args.seed)
    sc = setup.scenario(1)
    summary = {"config": args.ray_config, "num_replicas": config.replicas.num_replicas,
               "setup": dataclasses.asdict(setup), "num_blocks": sc.plan.num_blocks,
               "kv_pool_gib": sc.plan.kv_pool_bytes / 2**30, "kv_pool_tokens": sc.plan.num_tokens,
               "max_model_len": sc.max_model_len, "dataset": args.dataset_name, "num_prompts": len(requests),
               "request_rate": args.request_rate}
    if args.json:
        print(json.dumps({**summary, "replicas": rows}, indent=2))
        return 0
    print(f"{args.ray_config}: {config.replicas.num_replicas} replicas of {model} on {args.hardware} "
          f"({setup.dtype} weights, {sc.cost.kv_dtype} KV), router {setup.policy}; each replica's KV pool "
          f"{summary['kv_pool_gib']:.2f} GiB = {sc.plan.num_blocks:,} blocks x {setup.block_size} = "
          f"{sc.plan.num_tokens:,} tokens, max_num_seqs {setup.max_num_seqs}, "
          f"{setup.max_num_batched_tokens}-token steps, max_model_len {sc.max_model_len:,}")
    print(f"workload: {args.dataset_name}, {len(requests)} requests at {args.request_rate} req/s (seed {args.seed})")
    print("".join(f"{name:>11}" for name, _, _ in COLUMNS))
    for r in rows:
        print("".join(f"{fmt.format(r[key]):>11}" for _, key, fmt in COLUMNS))
    return 0
