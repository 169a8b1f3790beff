"""The application: `build_app` for `serve run`, `deployments` for code, and
`pagedserve serve-ray CONFIG.yaml` (cmd_serve_ray), which joins the Ray cluster (RAY_ADDRESS,
else the local one, else a new local one), starts Serve's HTTP proxy on the config's
`http` address and runs the app until interrupted."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment

from .ingress import Ingress
from .replica import EngineReplica
from .request_router import CacheAwareRequestRouter
from .settings import RayServeConfig

logger = logging.getLogger("pagedserve.ray_serve")
APP_NAME = "pagedserve"
ENGINE_DEPLOYMENT = "PagedServeEngine"
PREFILL_DEPLOYMENT = "PagedServePrefill"
DECODE_DEPLOYMENT = "PagedServeDecode"
INGRESS_DEPLOYMENT = "PagedServeIngress"
# A replica loads its model before it is healthy; a health check covers one engine step.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0


def deployments(config: RayServeConfig) -> Application:
    """The ingress bound to the engine deployment, whose replicas the cache-aware router picks;
    with `disaggregated`, to a decode deployment and a prefill deployment."""
    server = dataclasses.replace(config.server, api_key=None)  # only the ingress is reachable: it checks the key
    # The ingress tokenises (for the router's keys) and relays bytes: it reserves no CPU.
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0})
    pd = config.disaggregated
    if pd is None:
        return ingress.bind(_engine(config, ENGINE_DEPLOYMENT).bind(server), config)
    roles = [(PREFILL_DEPLOYMENT, "kv_producer", pd.prefill_replicas),
             (DECODE_DEPLOYMENT, "kv_consumer", pd.decode_replicas)]
    prefill, decode = (_engine(config, name, replicas).bind(
        dataclasses.replace(server, engine=pd.engine(server.engine, role))) for name, role, replicas in roles)
    return ingress.bind(decode, config, prefill)


def _engine(config: RayServeConfig, name: str, num_replicas: int | None = None) -> Deployment:
    router = config.router
    return serve.deployment(
        EngineReplica, name=name, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        request_router_config=RequestRouterConfig(
            request_router_class=CacheAwareRequestRouter, request_router_kwargs=dataclasses.asdict(router),
            request_routing_stats_period_s=router.stats_period_s,
            request_routing_stats_timeout_s=max(HEALTH_CHECK_TIMEOUT_S, router.stats_period_s)),
        **config.replicas.deployment_options(config.server.engine, num_replicas))


def build_app(args: dict[str, Any]) -> Application:
    """`serve run pagedserve.entrypoints.ray_serve.app:build_app config=CONFIG.yaml`, or the
    file's sections given inline as the args (a KubeRay RayService's serveConfigV2 does that)."""
    if "config" in args:
        if len(args) > 1:
            raise ValueError(f"build_app takes config=PATH or the config's sections, not both; got {sorted(args)}")
        return deployments(RayServeConfig.load(args["config"]))
    return deployments(RayServeConfig.from_dict(args))


def cmd_serve_ray(args: argparse.Namespace) -> int:
    config = RayServeConfig.load(args.config)
    ray.init(logging_level=logging.WARNING)
    # After ray.init, whose own SIGTERM handler would abort the process: a signal from here on
    # (while the app deploys, too) shuts Serve down and exits 0.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.server.host, "port": config.server.port})
        serve.run(deployments(config), name=APP_NAME, route_prefix="/")
        logger.info("serving on http://%s:%d (Ctrl-C stops)", config.server.host, config.server.port)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
