"""A tensor-parallel rank other than 0: join the group, load its shard, then run every
step rank 0 broadcasts until told to shut down (or until rank 0 goes away, which
fails the next collective and ends the process non-zero).

`run_node` is `pagedserve worker`: the ranks of one host other than the engine's."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass

import torch

from ..attention.selector import default_backend_name, get_backend
from ..engine_config import EngineConfig
from ..kernels import kernel_report
from ..model.device import resolve_device_name
from ..resolved_config import ResolvedConfig
from ..worker.kv_tensors import allocate_kv_caches, copy_blocks, kv_cache_torch_dtype
from . import step_message
from .group import TPGroup
from .loading import load_parallel_model
from .step_message import InitInfo, Kind, StepTensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    """What a spawned rank is started with (pickled over spawn's local pipe only)."""

    config: ResolvedConfig
    rank: int
    init_method: str


def worker_main(args: WorkerArgs) -> None:
    """The spawn target. Exits 0 after SHUTDOWN, raises (exit 1) on any failure."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{args.rank} %(name)s: %(message)s",
                        stream=sys.stderr)
    config = args.config
    torch.set_num_threads(config.parallel.rank_num_threads())
    serve_rank(config, args.rank, args.init_method)
    TPGroup.destroy()
    # Told to shut down: nothing is left to save, and the interpreter's own teardown of
    # torch takes seconds the engine would spend waiting in join().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@torch.inference_mode()
def serve_rank(config: ResolvedConfig, rank: int, init_method: str) -> None:
    """`config`: resolved (EngineConfig.resolve), by rank 0's engine or by `run_node`."""
    kernels = config.device.kernels
    size = config.parallel.tensor_parallel_size
    loaded, group = load_parallel_model(config.load.model, rank, size, lambda: TPGroup.join(init_method, rank, size))
    model = loaded.model
    model.set_kernels(kernels)
    backend = get_backend(config.device.attention_backend or default_backend_name(kernels))
    kind, info = step_message.receive(group)
    if kind == Kind.SHUTDOWN:  # rank 0 gave up before the KV pool was sized
        return
    if kind != Kind.INIT:
        raise ValueError(f"rank {group.rank}: expected INIT first, got {kind.name}")
    assert isinstance(info, InitInfo)
    info.check_model(loaded.config)
    group.all_gather_objects(kernel_report(kernels))  # rank 0 says what every rank runs
    kv_caches = allocate_kv_caches(model, info.num_blocks, info.block_size, kv_cache_torch_dtype(info.kv_cache_dtype))
    logger.info("rank %d of %d ready: %d KV blocks of %d tokens", group.rank, group.size, info.num_blocks,
                info.block_size)
    while True:
        kind, step = step_message.receive(group, info.block_size)
        if kind == Kind.SHUTDOWN:
            logger.info("rank %d: shutdown", group.rank)
            return
        assert isinstance(step, StepTensors)
        if step.copy_src.numel():
            copy_blocks(kv_caches, step.copy_src, step.copy_dst)
        if step.runs:
            backend.prepare(step.meta)
            model(step.input_ids, step.positions, kv_caches, step.meta, backend, step.logits_indices)


def node_ranks(config: ResolvedConfig) -> range:
    per = config.parallel.ranks_per_node
    return range(config.parallel.node_rank * per, (config.parallel.node_rank + 1) * per)


def spawn_ranks(config: ResolvedConfig, ranks: range, init_method: str) -> list[mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        p = ctx.Process(target=worker_main, args=(WorkerArgs(config, rank, init_method),),
                        name=f"pagedserve-tp-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def run_node(config: EngineConfig) -> int:
    """`pagedserve worker`: run this node's ranks until they end; non-zero if any failed."""
    resolved = config.resolve(resolve_device_name(config.device), for_worker=True)
    ranks = node_ranks(resolved)
    init_method = resolved.parallel.distributed_init_method
    if len(ranks) == 1:  # run it here (worker_main ends the process): a child of its own would only be waited for
        worker_main(WorkerArgs(resolved, ranks[0], init_method))
    procs = spawn_ranks(resolved, ranks, init_method)
    codes = []
    for p in procs:
        p.join()
        codes.append(p.exitcode)
    logger.info("ranks %s exited with %s (pid %d)", list(ranks), codes, os.getpid())
    return 0 if all(c == 0 for c in codes) else 1
