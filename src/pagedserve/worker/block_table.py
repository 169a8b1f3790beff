"""Block tables of the running requests, kept in one persistent array.

Each running request owns a row; the scheduler sends only the blocks a request
gained (or, after preemption or a copy-on-write, its whole table), so a step
writes a few entries instead of rebuilding every table.
"""
from __future__ import annotations

import numpy as np


class BlockTableRows:
    def __init__(self, max_rows: int, max_blocks_per_seq: int):
        self.table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def set(self, request_id: str, block_ids: list[int]) -> int:
        """Give the request a row (if it has none) holding exactly `block_ids`."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError("more running requests than block-table rows")
            row = self._free_rows.pop()
            self.row_of[request_id] = row
        self._check_width(request_id, len(block_ids))
        self.table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        return row

    def append(self, request_id: str, block_ids: list[int]) -> None:
        row = self.row_of[request_id]
        n = int(self.num_blocks[row])
        self._check_width(request_id, n + len(block_ids))
        self.table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self._free_rows.append(row)

    def _check_width(self, request_id: str, n: int) -> None:
        if n > self.table.shape[1]:
            raise RuntimeError(f"request {request_id} needs {n} blocks; rows hold {self.table.shape[1]}")
