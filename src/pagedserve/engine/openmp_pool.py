"""Keep one OpenMP worker pool in the process, so the engine thread's workers spin.

GNU OpenMP (libgomp, which torch's CPU wheels bundle) gives every thread that opens a
parallel region its own pool of workers, and counts all of them together. Once that
count exceeds the CPUs, every idle worker spins ~100 iterations instead of ~300,000
before it sleeps on a futex, so each later region pays a futex wake-up. The thread
that loads the model (the process's main thread) keeps its pool after loading, and
the engine thread then gets a second one: on 2 CPUs that is 3 managed threads for
2 CPUs, and every region the engine opens costs ~15 us more — ~20% of a served step
(docs/notebook/2026-rounds.md, fifth and sixth rounds). Freeing the loading thread's pool
before the engine thread starts brings the count back to what the CPUs hold.
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads stop, the runtime stays initialised


_found: ctypes.CDLL | None = None


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None. Only a find is
    remembered: asked before torch is imported, a later call still looks again."""
    global _found
    if _found is not None:
        return _found
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already mapped: the same library, not a second copy
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            _found = lib
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP workers (it gets new ones at its next parallel
    region). Call it on a thread that is done with parallel work before another thread
    takes over the compute. False where there is no libgomp to ask (another OpenMP
    runtime, or none loaded), which leaves everything as it was."""
    lib = _libgomp()
    if lib is None:
        return False
    if lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) != 0:
        logger.debug("omp_pause_resource_all refused (inside a parallel region?)")
        return False
    return True
