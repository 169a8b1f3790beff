"""The tensor-parallel process group and the collectives the sharded model runs.

Two groups over the same ranks: `control` carries the step headers, on which a worker
waits for as long as the engine stays idle (a day); `compute` carries everything else
(step payloads, all-reduces, the logits gather) with a short timeout, so a rank that
stops answering mid-step makes the others raise instead of hanging. A rank that dies
closes its sockets and the next collective fails at once; the timeout covers one that
hangs.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Long enough for the slowest step a CPU rank runs (a 2,048-token prefill of a large
# model), short enough that a stuck rank is reported within a minute.
COLLECTIVE_TIMEOUT_S = 60.0
IDLE_TIMEOUT = datetime.timedelta(days=1)


def free_local_init_method() -> str:
    return free_init_method("127.0.0.1")


def free_init_method(host: str) -> str:
    """tcp://host:port with a port free on `host` now (rank 0 listens there)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones (pagedserve's model runs on the CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class TPGroup:
    rank: int
    size: int
    control: dist.ProcessGroup
    compute: dist.ProcessGroup

    @classmethod
    def join(cls, init_method: str, rank: int, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S,
             device: torch.device = torch.device("cpu")) -> "TPGroup":
        """Join the default group (blocks until all `size` ranks have, at most `timeout_s`)."""
        backend = backend_for(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        ranks = list(range(size))
        control = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend=backend)
        compute = dist.new_group(ranks, timeout=timeout, backend=backend)
        return cls(rank, size, control, compute)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, added in rank order on every rank: each row's result is the
        same whatever the batch around it and on every rank (a ring all-reduce adds in
        an order that depends on the tensor's size, so with 3+ ranks a row's bits would
        change with the batch)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.compute)
        out = parts[0]
        for p in parts[1:]:
            out += p
        return out

    def all_gather_objects(self, value: object) -> list[object]:
        """Every rank's `value`, in rank order, on every rank (small picklable values)."""
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, value, group=self.compute)
        return out

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `x` laid side by side along the last dim; others: `x`."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.compute)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, idle: bool = False) -> None:
        dist.broadcast(x, 0, group=self.control if idle else self.compute)

    @staticmethod
    def destroy() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
