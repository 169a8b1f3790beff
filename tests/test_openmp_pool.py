"""The process keeps one OpenMP worker pool: release_thread_pool() frees the calling
thread's workers (counted as OS threads), parallel work after it still computes the same,
and AsyncEngine.start() frees the starting thread's pool before its engine thread runs."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from engine_utils import make_llm
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.openmp_pool import _libgomp, release_thread_pool
from pagedserve.model.loader import load_model


def test_torch_here_runs_on_gnu_openmp():
    # The fix is a no-op under another runtime: if torch's wheel ever changes it, this
    # fails (and the served-step slowdown needs looking at again) rather than skipping.
    assert _libgomp() is not None, "torch did not load libgomp; release_thread_pool() would do nothing"


def num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads():
    """Two OpenMP threads: a parallel region then starts one worker beside the caller."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def parallel_work(x: torch.Tensor) -> torch.Tensor:
    return x.exp()  # 1M elements: far above the grain size, so it opens a region


def test_release_frees_the_calling_threads_workers(two_threads) -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    expected = parallel_work(x)
    with_pool = num_os_threads()
    assert release_thread_pool()
    assert num_os_threads() == with_pool - 1
    assert torch.equal(parallel_work(x), expected)  # a new pool, the same result
    assert num_os_threads() == with_pool


def test_release_leaves_other_threads_pools(two_threads) -> None:
    x = torch.randn(1 << 20)
    parallel_work(x)  # this thread's pool
    ready, done = threading.Event(), threading.Event()

    def other() -> None:
        torch.set_num_threads(2)
        parallel_work(x)  # that thread's pool
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert ready.wait(10)
        both = num_os_threads()
        assert release_thread_pool()
        assert num_os_threads() == both - 1
    finally:
        done.set()
        thread.join()


def test_async_engine_start_frees_the_loading_threads_pool(two_threads) -> None:
    llm = make_llm(load_model())
    torch.set_num_threads(2)  # the engine set its own count
    parallel_work(torch.randn(1 << 20))  # as model loading and warm-up leave it

    async def scenario() -> int:
        before = num_os_threads()
        engine = AsyncEngine(llm.engine)
        engine.start()  # one engine thread in, this thread's worker out
        try:
            return num_os_threads() - before
        finally:
            await engine.close()

    assert asyncio.run(scenario()) == 0
