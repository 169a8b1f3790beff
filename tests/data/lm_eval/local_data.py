"""Load a task's documents from a JSON-lines file next to this one (lm-eval's
`custom_dataset`): no hub, no dataset cache, any working directory."""
from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def load(data_file: str, **_: object) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / data_file).read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
