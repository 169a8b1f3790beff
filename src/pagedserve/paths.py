"""Where pagedserve keeps what it derives on this machine: converted model weights and
the CPU calibration. One home, so the loader, the engine and the simulator agree, and
no torch import, so the simulator can use it."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))


def calibration_path() -> Path:
    """`pagedserve sim calibrate`'s measurements of this CPU (sim/hardware.py's Calibration)."""
    return cache_root() / "cpu-local.json"
