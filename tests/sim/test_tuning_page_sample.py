"""The Tuning page's `doctor --tune` sample is what the command prints today: the command is
run as docs/tuning.md writes it and the page's output block must be the start of its output."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

TUNING = Path(__file__).resolve().parents[2] / "docs" / "tuning.md"


def test_tuning_page_sample_is_the_commands_output():
    text = TUNING.read_text()
    match = re.search(r"```bash\n\.venv/bin/pagedserve (doctor --tune[^`]*?)\n```\n```\n(.*?)\n```", text, re.S)
    assert match, "the Tuning page's doctor --tune sample moved: update this test's pattern"
    args = shlex.split(match.group(1).replace("\\\n", " "))
    shown = match.group(2).splitlines()
    out = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", *args], capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()
    assert out[: len(shown)] == shown
