"""core/ must import without torch, numpy or anything outside the standard library:
the simulator runs the real scheduler where none of them is installed."""
from __future__ import annotations

import subprocess
import sys

# Loads pagedserve.core with the parent package's __init__ skipped, to judge core's
# own imports apart from whatever the package root pulls in.
CORE_ALONE = """
import importlib.util, sys, types
spec = importlib.util.find_spec("pagedserve")
root = types.ModuleType("pagedserve")
root.__path__ = list(spec.submodule_search_locations)
sys.modules["pagedserve"] = root
before = set(sys.modules)
import pagedserve.core
import pagedserve.core.block_hash, pagedserve.core.policies, pagedserve.core.request_queue
loaded = {name.split(".")[0] for name in set(sys.modules) - before}
print(",".join(sorted(n for n in loaded if n not in sys.stdlib_module_names and n != "pagedserve")))
"""


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_core_modules_import_only_the_standard_library():
    assert run(CORE_ALONE) == "", "pagedserve.core itself imports non-stdlib modules"


def test_importing_pagedserve_core_does_not_import_torch():
    # The way the simulator imports it: the package root runs first, so it must
    # not import the engine (torch) eagerly either.
    loaded = run("import sys, pagedserve.core; print(sorted({'torch', 'numpy'} & set(sys.modules)))")
    assert loaded == "[]", f"import pagedserve.core loaded {loaded}"
