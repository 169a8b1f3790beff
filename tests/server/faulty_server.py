"""`pagedserve serve` with a fault injected into the engine: the Nth forward step
(PAGEDSERVE_TEST_FAIL_STEP=N) raises, as a kernel or model bug would. The hook is a
patch of LLMEngine.step made here, so the product code carries no test switch.

    python -m tests.server.faulty_server serve --port ...
"""
from __future__ import annotations

import os
import sys

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import main

FAIL_STEP_ENV = "PAGEDSERVE_TEST_FAIL_STEP"


class InjectedFault(RuntimeError):
    pass


def inject_step_fault(fail_at: int) -> None:
    real_step = LLMEngine.step
    calls = 0

    def step(self: LLMEngine):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == fail_at:
            raise InjectedFault(f"fault injected into forward step {calls}")
        return real_step(self)

    LLMEngine.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    inject_step_fault(int(os.environ[FAIL_STEP_ENV]))
    sys.exit(main(sys.argv[1:]))
