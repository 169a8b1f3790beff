"""Every module is named in a document: a newcomer who meets a file in the tree finds
what it is for in docs/. A module counts as named when its path under
src/pagedserve/ appears in a docs page or the README."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pagedserve"


def _documents() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_every_module_is_named_in_a_document():
    text = _documents()
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert len(modules) > 100  # the tree was found
    unnamed = [m for m in modules if m not in text]
    assert not unnamed, f"modules named in no document (add them to docs/architecture.md's table): {unnamed}"


def test_the_reading_path_names_files_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## Start here")
    path = text[start:text.index("\n## ", start + 1)]
    named = [w.strip("`") for w in path.split() if w.startswith("`") and w.rstrip("`,:.)").endswith(".py")]
    assert len(named) >= 10
    for name in named:
        name = name.rstrip("`,:.)")
        assert (PACKAGE / name).is_file() or any(PACKAGE.rglob(name)), name
