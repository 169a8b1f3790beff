"""The soak script itself, for 8 seconds: every kind of request it sends comes back
with the status it expects (bad ones 400, none 5xx, no transport error), the engine
is empty afterwards and the server exits 0 on SIGTERM. The RSS-slope verdict is left
out (`--max-rss-slope-mib-per-min` huge): 8 seconds are all warm-up; the 20-minute run
in docs/reliability.md is where it is judged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_short_soak_passes_every_check_but_the_slope(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), "--duration", "8", "--clients", "4", "--interval", "2", "--warmup", "0",
         "--max-rss-slope-mib-per-min", "1e9", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["server_errors"] == 0 and report["transport_errors"] == 0 and not report["errors"]
    assert report["server_exit_code"] == 0
    assert not any(report["engine_after"].values())
    kinds = {kind.split()[0] for kind in report["by_kind"]}
    assert {"plain", "stream", "bad"} <= kinds
    assert all(kind.endswith(" 400") for kind in report["by_kind"] if kind.startswith("bad"))
    assert len(report["samples"]) >= 3
