"""Tensor-parallel ranks 1 .. N-1 as Ray actors (`--distributed-executor-backend ray`).

Rank 0 stays the engine process, as with the mp backend; it joins the Ray cluster
(RAY_ADDRESS, else the one running on this host, else a local one it starts). One
placement group holds a bundle of `num_threads` CPUs (default 1) per rank: bundle 0,
rank 0's, is pinned to the engine's node by its node-id label, and the group is
STRICT_PACK when the engine's node has the CPUs for every rank, else SPREAD, so the
ranks cross nodes only when they must. Each actor runs the mp backend's rank loop
(worker.serve_rank); the collectives stay on torch.distributed (gloo), which the ranks
join at the engine node's IP and a port free there.

An actor that dies (killed, its node lost, an exception in the loop) ends its `serve`
call; a thread waiting on those calls records why, and the executor reports it before
the next step or through its watcher, as it does for a spawned process that exits.
Actors are never restarted: a fresh rank could not rejoin a group whose peer left.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..resolved_config import ParallelConfig, ResolvedConfig
from .group import TPGroup, free_init_method
from .ranks import RankFailedError
from .worker import serve_rank

logger = logging.getLogger(__name__)

# How long the cluster gets to find room for the placement group and start the actors.
PLACEMENT_TIMEOUT_S = 120.0
NODE_ID_LABEL = "ray.io/node-id"
# Passed on to the rank actors: gloo's interface choice is per host, as with `pagedserve worker`.
FORWARDED_ENV = ("GLOO_SOCKET_IFNAME",)
_POLL_S = 0.5


@dataclass(frozen=True)
class RankPlace:
    rank: int
    node_id: str
    node_ip: str
    pid: int


class RankActor:
    """One rank; `serve` returns after SHUTDOWN and raises if the rank loop fails."""

    def place(self, rank: int) -> RankPlace:
        context = ray.get_runtime_context()
        return RankPlace(rank, context.get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def serve(self, config: ResolvedConfig, rank: int, init_method: str) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
        torch.set_num_threads(rank_cpus(config.parallel))
        try:
            serve_rank(config, rank, init_method)
        finally:
            TPGroup.destroy()


def rank_cpus(parallel: ParallelConfig) -> int:
    """CPUs each rank's bundle reserves, and the torch threads it runs: Ray's accounting is
    where a rank's share of a node is stated."""
    return parallel.num_threads or 1


def placement_strategy(node_cpus: float, parallel: ParallelConfig) -> str:
    """STRICT_PACK when the engine's node holds every rank's CPUs, else SPREAD."""
    return "STRICT_PACK" if node_cpus >= parallel.tensor_parallel_size * rank_cpus(parallel) else "SPREAD"


class RayRanks:
    """The actors of ranks 1 .. N-1 in their placement group; `init_method` is where they meet rank 0."""

    def __init__(self, config: ResolvedConfig):
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(logging_level=logging.WARNING)
        self.places: list[RankPlace] = []
        self._actors: list[ray.actor.ActorHandle] = []
        self._runs: dict[ray.ObjectRef, RankPlace] = {}
        self.placement_group: PlacementGroup | None = None
        self._failure: RankFailedError | None = None
        self._stopping = threading.Event()
        self._follower: threading.Thread | None = None
        try:
            self.placement_group = self._place(config)
            self._start_actors(config)
        except BaseException:
            self.stop(0)
            raise
        self._follower = threading.Thread(target=self._follow, name="pagedserve-ray-ranks", daemon=True)
        self._follower.start()

    def _place(self, config: ResolvedConfig) -> PlacementGroup:
        here = ray.get_runtime_context().get_node_id()
        node_cpus = next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == here), 0)
        size, cpus = config.parallel.tensor_parallel_size, rank_cpus(config.parallel)
        strategy = placement_strategy(node_cpus, config.parallel)
        pg = placement_group([{"CPU": cpus}] * size, strategy=strategy,
                             bundle_label_selector=[{NODE_ID_LABEL: here}] + [{}] * (size - 1))
        if not pg.wait(PLACEMENT_TIMEOUT_S):
            remove_placement_group(pg)
            raise RankFailedError(
                f"the Ray cluster found no room in {PLACEMENT_TIMEOUT_S:.0f} s for {size} bundles of {cpus} CPU "
                f"({strategy}, bundle 0 on the engine's node); ray.available_resources() = "
                f"{ray.available_resources()}")
        logger.info("placement group %s: %d ranks x %d CPU, %s", pg.id.hex(), size, cpus, strategy)
        return pg

    def _start_actors(self, config: ResolvedConfig) -> None:
        env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
        actor_class = ray.remote(max_restarts=0, max_task_retries=0)(RankActor)
        for rank in range(1, config.parallel.tensor_parallel_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            options = dict(num_cpus=rank_cpus(config.parallel), scheduling_strategy=strategy,
                           name=f"pagedserve-tp-rank{rank}-{self.placement_group.id.hex()[:8]}")
            if env:
                options["runtime_env"] = {"env_vars": env}
            self._actors.append(actor_class.options(**options).remote())
        self.places = ray.get([a.place.remote(rank) for rank, a in enumerate(self._actors, start=1)],
                              timeout=PLACEMENT_TIMEOUT_S)
        self.init_method = free_init_method(ray.util.get_node_ip_address())
        self._runs = {a.serve.remote(config, p.rank, self.init_method): p for a, p in zip(self._actors, self.places)}
        logger.info("tensor-parallel ranks on Ray: %s; rendezvous %s",
                    ", ".join(f"rank {p.rank} pid {p.pid} on {p.node_ip} ({p.node_id[:8]})" for p in self.places),
                    self.init_method)

    def _follow(self) -> None:
        """Wait on the actors' `serve` calls; the first to end before `stop` is the failure."""
        pending = dict(self._runs)
        while pending and not self._stopping.is_set():
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                place = pending.pop(ref)
                if not self._stopping.is_set() and self._failure is None:
                    self._failure = _why_ended(place, ref)

    def dead(self) -> RankFailedError | None:
        return self._failure

    def stop(self, timeout_s: float) -> None:
        self._stopping.set()
        runs = list(self._runs)
        if runs and timeout_s > 0:
            ray.wait(runs, num_returns=len(runs), timeout=timeout_s)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._follower is not None:  # out of ray.wait before Ray goes away under it
            self._follower.join(2 * _POLL_S)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _why_ended(place: RankPlace, ref: ray.ObjectRef) -> RankFailedError:
    where = f"tensor-parallel rank {place.rank} (Ray actor pid {place.pid} on {place.node_ip})"
    try:
        ray.get(ref, timeout=0)
    except RayActorError as e:
        return RankFailedError(f"{where} died: {str(e).splitlines()[0]}")
    except RayError as e:
        return RankFailedError(f"{where} failed: {str(e).splitlines()[-1]}")
    return RankFailedError(f"{where} exited")
