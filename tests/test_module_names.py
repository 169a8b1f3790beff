"""One name per thing: no two modules in src/pagedserve share a file name (`__init__.py`
aside), so a basename in a traceback, a profile or a review comment names one file, and
its path says what it holds (router/proxy.py, worker/kv_tensors.py) rather than which
package it sits in."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pagedserve"


def repeated_basenames(root: Path) -> dict[str, list[str]]:
    """Each file name used by more than one module under `root`, with the modules' paths."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            paths[path.name].append(path.relative_to(root).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_modules_share_a_file_name():
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the tree was found
    repeated = repeated_basenames(PACKAGE)
    assert not repeated, f"rename so each path says what it holds: {repeated}"


def test_the_check_sees_a_repeated_name_and_ignores_packages(tmp_path):
    for rel in ("a/__init__.py", "b/__init__.py", "a/metrics.py", "b/metrics.py", "b/other.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert repeated_basenames(tmp_path) == {"metrics.py": ["a/metrics.py", "b/metrics.py"]}
