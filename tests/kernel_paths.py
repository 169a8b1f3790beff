"""Run an op on every path the native library can take for it, so a test can check that
a row's bits depend on none of them."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch


def outputs_on_every_path(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                          row_counts: Sequence[int]) -> list[torch.Tensor]:
    """fn(x[:rows]) for each row count, on 1 and 2 threads, on the widest instruction set
    the CPU has and held to AVX2 (PAGEDSERVE_NATIVE_ISA); the thread count and the variable
    are restored afterwards."""
    threads, isa = torch.get_num_threads(), os.environ.get("PAGEDSERVE_NATIVE_ISA")
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for path in ("auto", "avx2"):
                os.environ["PAGEDSERVE_NATIVE_ISA"] = path
                results.extend(fn(x[:rows]) for rows in row_counts)
    finally:
        torch.set_num_threads(threads)
        if isa is None:
            os.environ.pop("PAGEDSERVE_NATIVE_ISA", None)
        else:
            os.environ["PAGEDSERVE_NATIVE_ISA"] = isa
    return results
