"""Rank 0's side of tensor parallelism, in the engine's own process.

Rank 0 is the engine process (vLLM's uniproc-plus-workers layout rather than N
workers beside a rank-less engine): the scheduler, block manager and sampler already
live here, the gathered logits land where they are sampled, and no extra process or
hop sits between a step's schedule and its forward on a 2-core machine.

The executor starts the other ranks (the mp backend spawns this node's; the ray
backend places every one as a Ray actor, ray_ranks.py), joins the group with them,
loads rank 0's shard, and then, once per step, broadcasts the step (step_message)
before rank 0 runs its own part of the forward. A rank it started that ends is noticed
before the next step and by a watcher thread while the engine idles (`on_failure`); a
rank another host started fails the next collective when it dies; a stuck one times
out (group.COLLECTIVE_TIMEOUT_S).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable

import torch

from ..kernels import kernel_report
from ..model.loader import LoadedModel, resolve_model
from ..resolved_config import ResolvedConfig
from ..worker.model_runner import StepInputs
from . import step_message
from .group import TPGroup, free_local_init_method
from .loading import load_parallel_model
from .ranks import RankFailedError, Ranks, SpawnedRanks
from .step_message import InitInfo, StepTensors
from .worker import spawn_ranks

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_JOIN_TIMEOUT_S = 10.0
_EMPTY = torch.empty(0, dtype=torch.int64)


class TensorParallelExecutor:
    def __init__(self, config: ResolvedConfig):
        if torch.distributed.is_initialized():
            raise ValueError("this process already holds a torch.distributed group (another tensor-parallel "
                             "engine?): one per process; shut the other engine down first")
        self.config = config
        init_method, self.ranks = _start_ranks(config)
        self.group: TPGroup | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._closed = False
        self._failure: RankFailedError | None = None
        atexit.register(self.shutdown)
        try:
            shard, self.group = load_parallel_model(config.load.model, 0, config.parallel.tensor_parallel_size,
                                                    lambda: self._join(init_method), with_tokenizer=True)
        except BaseException:
            self.shutdown()
            raise
        self.loaded = LoadedModel(shard.name, resolve_model(config.load.model), shard.config, shard.model, shard.tokenizer)
        self._watcher = threading.Thread(target=self._watch, name="pagedserve-tp-watch", daemon=True)
        self._watcher.start()

    def _join(self, init_method: str) -> TPGroup:
        """TPGroup.join, given up as soon as a local rank dies before it joins (rather than
        after the rendezvous timeout); the abandoned rendezvous thread ends with its timeout."""
        result: list[TPGroup | BaseException] = []

        def join() -> None:
            try:
                result.append(TPGroup.join(init_method, 0, self.config.parallel.tensor_parallel_size))
            except BaseException as e:  # handed to the caller's thread
                result.append(e)

        thread = threading.Thread(target=join, name="pagedserve-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_WATCH_INTERVAL_S)
            failure = self._dead_rank()
            if failure is not None and thread.is_alive():
                raise failure
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def start(self, num_blocks: int, block_size: int, kv_cache_dtype: str, kernels: str) -> None:
        """Tell every rank the KV pool's size; they allocate their shard of it and report the
        kernels they run (`rank_kernels`: each rank resolves --kernels on its own CPU)."""
        self._check()
        step_message.send_init(self.group, InitInfo.of(num_blocks, block_size, kv_cache_dtype, self.loaded.config))
        self.rank_kernels: list[str] = self.group.all_gather_objects(kernel_report(kernels))

    def run_step(self, inputs: StepInputs | None, copies: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Broadcast one step (ModelRunner.execute calls this before its own forward)."""
        self._check()
        src, dst = copies if copies is not None else (_EMPTY, _EMPTY)
        if inputs is None:
            step = StepTensors(_EMPTY, _EMPTY, None, _EMPTY, src, dst)
        else:
            step = StepTensors(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, src, dst)
        try:
            step_message.send_step(self.group, step)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise self._failed(e) from e

    def _failed(self, error: RuntimeError) -> RankFailedError:
        """The failure to report for a failed collective: the local rank that died, if one did
        (its exit is seen a moment after its sockets close), else the collective's error."""
        deadline = time.monotonic() + _JOIN_TIMEOUT_S / 10
        while (dead := self._dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._failure = dead or RankFailedError(f"a tensor-parallel rank stopped answering: {error}")
        return self._failure

    def _dead_rank(self) -> RankFailedError | None:
        return self.ranks.dead()

    def _check(self) -> None:
        if self._closed:
            raise RankFailedError("the tensor-parallel ranks were shut down")
        failure = self._failure or self._dead_rank()
        if failure is not None:
            self._failure = failure
            raise failure

    def _watch(self) -> None:
        while not self._closed:
            failure = self._dead_rank()
            if failure is not None:
                self._failure = failure
                logger.error("%s", failure)
                if self.on_failure is not None and not self._closed:
                    self.on_failure(failure)
                return
            threading.Event().wait(_WATCH_INTERVAL_S)

    def shutdown(self) -> None:
        """Stop every rank (SHUTDOWN if they can still hear it, else terminate) and leave the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.group is not None and self._failure is None and self._dead_rank() is None:
            try:
                step_message.send_shutdown(self.group)
            except RuntimeError as e:
                logger.warning("could not send SHUTDOWN to the tensor-parallel ranks: %s", e)
        self.ranks.stop(_JOIN_TIMEOUT_S)
        if self.group is not None:
            TPGroup.destroy()


def _start_ranks(config: ResolvedConfig) -> tuple[str, Ranks]:
    """The ranks other than 0 (this node's for mp, every one for ray), started, and the
    address where they meet rank 0."""
    parallel = config.parallel
    if parallel.distributed_executor_backend == "ray":
        from .ray_ranks import RayRanks  # here: ray is the `ray` extra's, which the mp backend does not need

        ranks = RayRanks(config)
        return ranks.init_method, ranks
    init_method = parallel.distributed_init_method or free_local_init_method()
    return init_method, SpawnedRanks(spawn_ranks(config, range(1, parallel.ranks_per_node), init_method))
