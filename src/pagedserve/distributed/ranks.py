"""The ranks other than 0, as the executor sees them whichever backend started them: it asks
whether one has died (before each step, and from a watcher thread while the engine idles)
and stops them at the end. `SpawnedRanks` are the mp backend's processes; the ray
backend's actors are `ray_ranks.RayRanks`."""
from __future__ import annotations

import multiprocessing as mp
from typing import Protocol


class RankFailedError(RuntimeError):
    """A tensor-parallel rank exited or stopped answering: the engine cannot step."""


class Ranks(Protocol):
    def dead(self) -> RankFailedError | None:
        """Why a rank has ended, if one has (cheap: called before every step)."""

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to end (after SHUTDOWN), then end them."""


class SpawnedRanks:
    """Processes this host spawned (distributed/worker.spawn_ranks), ranks 1, 2, ... in order."""

    def __init__(self, procs: list[mp.process.BaseProcess]):
        self.procs = procs

    def dead(self) -> RankFailedError | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return RankFailedError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
        return None

    def stop(self, timeout_s: float) -> None:
        for p in self.procs:
            p.join(timeout_s)
            if p.exitcode is None:
                p.kill()
                p.join()
