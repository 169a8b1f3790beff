"""The docs are a site that builds and a README that works.

`mkdocs build --strict` fails on any unresolved link or anchor and on any page left out of
the nav (mkdocs.yml's `validation` makes each a warning, which strict turns into an error).
README.md, the docs and the sources' comments speak only of what is in the repository: no
link that leaves it, no file that is not in it (notes beside the checkout, a shared folder),
no tracker issue number a reader cannot open: they say what was measured or decided. A docs page names a source file as a code path in backticks
(`benchmarks/peers.py`), never as a link, since the site holds only docs/. The README stays
short, and every command block it marks runnable (`<!-- runnable -->` on the line before
the fence) runs.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200
RUNNABLE = "<!-- runnable -->"

# A path that climbs out of where it is written (link targets inside docs/ are checked apart).
OUTSIDE_FILES = re.compile(r"PEERS\.md|DESIGN\.md|\.\./|shared/peers")
# "issue 7", "Issue #7", "(#7)", "project#7"; not an anchor such as "#2026-12-04-...".
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|#\d+(?![\w-])", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".js", ".html", ".css", ".jinja", ".sh"}


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _sources() -> list[Path]:
    """The code users read: the package (comments and docstrings) and the benchmark scripts."""
    return sorted(p for folder in (ROOT / "src", ROOT / "benchmarks") for p in folder.rglob("*")
                  if p.suffix in SOURCE_SUFFIXES and p.is_file())


def _link_targets(text: str) -> list[str]:
    """Relative link targets, less any anchor; web, mail and same-page links are left out."""
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#")[0])
    return targets


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_the_config_makes_broken_links_and_anchors_fail_the_strict_build():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    validation = config["validation"]
    for check in ("omitted_files", "unrecognized_links", "anchors", "absolute_links"):
        assert validation[check] == "warn", check


def test_the_site_builds_with_every_link_and_anchor_resolved(site: Path):
    assert (site / "index.html").is_file()
    assert (site / "benchmarks" / "index.html").is_file()


def test_readme_links_resolve_to_files_and_anchors_in_the_repository(site: Path):
    text = README.read_text()
    broken = []
    for raw in LINK.findall(text):
        if re.match(r"[a-z]+:", raw):
            continue
        target, _, anchor = raw.partition("#")
        path = (ROOT / target).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(raw)
            continue
        if anchor and path.suffix == ".md" and path.is_relative_to(DOCS):
            page = path.relative_to(DOCS).with_suffix("")
            html = site / ("index.html" if page.name == "index" else page / "index.html")
            if f'id="{anchor}"' not in html.read_text():
                broken.append(raw)
    assert not broken, f"README links to nothing in the repository or the site: {broken}"


def test_docs_pages_link_only_to_pages_of_the_site():
    """A source file is named as a code path in backticks: the site holds only docs/."""
    outside = []
    for page in sorted(DOCS.rglob("*.md")):
        for target in _link_targets(page.read_text()):
            path = (page.parent / target).resolve()
            if not path.is_relative_to(DOCS):
                outside.append(f"{page.relative_to(ROOT)}: {target}")
    assert not outside, f"links out of docs/ (write the path in backticks instead): {outside}"


def test_no_reference_to_files_outside_the_repository_or_to_issue_numbers():
    found = []
    for page in _pages() + _sources():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            line = LINK.sub("]()", line)
            for pattern in (OUTSIDE_FILES, ISSUE_NUMBER):
                match = pattern.search(line)
                if match:
                    found.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, "say what was measured or decided instead:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_are_for():
    for text in ("issue 39", "Issue #15's targets", "(#38)", "project#40004", "issues 12"):
        assert ISSUE_NUMBER.search(text), text
    for text in ("[x](benchmarks.md#2026-12-04-fast-by-default)", "W1-W4", "45 KiB", "rank 0"):
        assert not ISSUE_NUMBER.search(text), text
    for text in ("see PEERS" + ".md", "../" + "shared/peers/x.sh", "DESIGN" + ".md"):
        assert OUTSIDE_FILES.search(text), text


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def _runnable_blocks() -> list[str]:
    lines = README.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        assert lines[i + 1].startswith("```bash"), f"README line {i + 2}: {RUNNABLE} must precede a bash fence"
        end = lines.index("```", i + 2)
        blocks.append("\n".join(lines[i + 2:end]))
    return blocks


def test_readme_marks_runnable_blocks():
    assert _runnable_blocks(), f"README.md marks no command block {RUNNABLE}"


@pytest.mark.parametrize("block", _runnable_blocks(), ids=lambda block: block.splitlines()[0][:48])
def test_readme_runnable_block_runs(block: str):
    """Each command as the README writes it, with `.venv/bin/` the running interpreter's
    folder and this checkout's sources first on the path."""
    command = block.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{block}\nfailed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
