"""Batch jobs' state under --data-dir: files and batches in SQLite (WAL), file bodies on disk.

The one owner of the schema. A batch's input lines are copied into the `lines` table when
it is validated, so deleting its input file does not stop it; each line's result is one
row of `results` keyed by (batch_id, idx), inserted once, so after a crash (kill -9) the
runner resumes with the lines that have no row: none lost, none answered twice. A file's
body is written to a temporary file, fsynced and renamed into place before its row is
committed, so a row never names a half-written body.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, api TEXT NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, times TEXT NOT NULL DEFAULT '{}',
    output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL DEFAULT 0,
    metadata TEXT, errors TEXT);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, created_at);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx));
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, status_code INTEGER NOT NULL,
    request_id TEXT NOT NULL, body TEXT, error TEXT, PRIMARY KEY (batch_id, idx));
"""
# A batch in one of these still has work for the runner.
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class FileRow:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


@dataclass(frozen=True, slots=True)
class BatchRow:
    id: str
    owner: str
    api: str  # "openai" or "anthropic": whose shapes the routes answer in
    endpoint: str
    input_file_id: str | None
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    times: dict[str, int]  # status -> when the batch entered it (unix seconds)
    output_file_id: str | None
    error_file_id: str | None
    total: int
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None


@dataclass(frozen=True, slots=True)
class Line:
    batch_id: str
    idx: int
    custom_id: str | None
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineResult:
    """One line answered: the endpoint's status and JSON body (an error body when not 200)."""

    idx: int
    custom_id: str | None
    status_code: int
    request_id: str
    body: dict[str, Any] | None
    error: dict[str, Any] | None = None  # the line never reached the endpoint (malformed, expired)


@dataclass(frozen=True, slots=True)
class Counts:
    succeeded: int
    errored: int


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    """The database and the file bodies under `data_dir`. Every method may be called from
    the event loop or a worker thread (one connection, serialised by a lock)."""

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit survives the process being killed (WAL), only a power cut may lose the last ones.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def _write(self, statements: Iterable[tuple[str, Iterable[Any]]]) -> list[int]:
        """Run the statements in one transaction; each one's number of changed rows."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                changed = [self._db.execute(sql, tuple(args)).rowcount for sql, args in statements]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return changed

    # -- files ----------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def temp_upload(self) -> tuple[Path, BinaryIO]:
        """A temporary file in the files folder (same file system: the rename is atomic)."""
        path = self.files_dir / f".upload-{uuid.uuid4().hex}"
        return path, open(path, "wb")

    def add_file(self, temp: Path, handle: BinaryIO, owner: str, purpose: str, filename: str) -> FileRow:
        """Make a written temporary file a stored file: fsync, rename into place, commit its row."""
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        row = FileRow(new_id("file-"), owner, purpose, filename, temp.stat().st_size, int(time.time()))
        os.replace(temp, self.file_path(row.id))
        _fsync_dir(self.files_dir)
        self._write([_file_insert(row)])
        return row

    def stage_file(self, owner: str, purpose: str, filename: str, lines: Iterable[str]) -> FileRow:
        """Write a file's body in place (atomically) without its row: finish_batch commits
        the row with the batch's new status, so a crash between leaves no half-done batch."""
        temp, handle = self.temp_upload()
        with handle:
            for line in lines:
                handle.write(line.encode("utf-8") + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        row = FileRow(new_id("file-"), owner, purpose, filename, temp.stat().st_size, int(time.time()))
        os.replace(temp, self.file_path(row.id))
        _fsync_dir(self.files_dir)
        return row

    def get_file(self, file_id: str, owner: str) -> FileRow | None:
        rows = self._rows("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return FileRow(*rows[0]) if rows else None

    def list_files(self, owner: str, purpose: str | None, limit: int, after: str | None) -> list[FileRow]:
        sql, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after is not None:
            sql, args = sql + " AND rowid < (SELECT rowid FROM files WHERE id = ?)", [*args, after]
        return [FileRow(*r) for r in self._rows(sql + " ORDER BY rowid DESC LIMIT ?", [*args, limit])]

    def delete_file(self, file_id: str, owner: str) -> bool:
        changed = self._write([("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))])
        if changed[0]:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(changed[0])

    def stored_bytes(self, owner: str) -> int:
        return self._rows("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner = ?", (owner,))[0][0]

    def remove_strays(self) -> None:
        """Bodies a crash left without a row: interrupted uploads, output files of a batch
        whose finish was not committed."""
        known = {row[0] for row in self._rows("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name.startswith(".upload-") or path.stem not in known:
                path.unlink(missing_ok=True)

    # -- batches --------------------------------------------------------------------------

    def add_batch(self, batch: BatchRow, lines: Iterable[Line] = ()) -> None:
        self._write([("INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _batch_fields(batch)),
                     *_line_inserts(lines)])

    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRow | None:
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        rows = self._rows(sql, args)
        return _batch(rows[0]) if rows else None

    def list_batches(self, owner: str, api: str, limit: int, after: str | None) -> list[BatchRow]:
        sql, args = "SELECT * FROM batches WHERE owner = ? AND api = ?", [owner, api]
        if after is not None:
            sql, args = sql + " AND rowid < (SELECT rowid FROM batches WHERE id = ?)", [*args, after]
        return [_batch(r) for r in self._rows(sql + " ORDER BY rowid DESC LIMIT ?", [*args, limit])]

    def active_batches(self) -> list[BatchRow]:
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        return [_batch(r) for r in self._rows(
            f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY created_at, rowid", ACTIVE_STATUSES)]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] | None = None,
                   **fields: Any) -> bool:
        """Move a batch to `status` (stamping when), with other columns; with `only_from`,
        only if it is in one of those statuses now. Whether it moved."""
        batch = self.get_batch(batch_id)
        if batch is None or (only_from is not None and batch.status not in only_from):
            return False
        times = {**batch.times, status: int(time.time())}
        columns = {"status": status, "times": json.dumps(times), **{
            name: json.dumps(value) if name in ("errors", "metadata") else value for name, value in fields.items()}}
        assignments = ", ".join(f"{name} = ?" for name in columns)
        where, args = "id = ?", [batch_id]
        if only_from is not None:
            where += f" AND status IN ({', '.join('?' * len(only_from))})"
            args += list(only_from)
        return bool(self._write([(f"UPDATE batches SET {assignments} WHERE {where}", [*columns.values(), *args])])[0])

    def finish_batch(self, batch_id: str, status: str, files: dict[str, FileRow | None],
                     only_from: tuple[str, ...]) -> bool:
        """Commit the batch's output files (column -> row) and its final status together."""
        batch = self.get_batch(batch_id)
        times = json.dumps({**batch.times, status: int(time.time())})
        columns = {name: None if row is None else row.id for name, row in files.items()}
        assignments = "".join(f", {name} = ?" for name in columns)
        marks = ", ".join("?" * len(only_from))
        changed = self._write([*(_file_insert(row) for row in files.values() if row is not None),
                               (f"UPDATE batches SET status = ?, times = ?{assignments} WHERE id = ? AND status IN "
                                f"({marks})", (status, times, *columns.values(), batch_id, *only_from))])
        return bool(changed[-1])

    def start_batch(self, batch_id: str, lines: list[Line], early: list[LineResult]) -> None:
        """Validation passed: the lines to run, the results of those that failed it, in_progress."""
        batch = self.get_batch(batch_id)
        times = json.dumps({**batch.times, "in_progress": int(time.time())})
        self._write([*_line_inserts(lines), *_result_inserts(batch_id, early),
                     ("UPDATE batches SET status = 'in_progress', times = ?, total = ? WHERE id = ? "
                      "AND status = 'validating'", (times, len(lines) + len(early), batch_id))])

    # -- lines and results -------------------------------------------------------------------

    def pending_lines(self, batch_id: str, limit: int, skip: set[int], start: int = 0) -> list[Line]:
        """The first `limit` lines of the batch from index `start` without a result, less
        those in `skip` (`start` spares a long batch rescanning its answered lines)."""
        rows = self._rows(
            "SELECT l.batch_id, l.idx, l.custom_id, l.body FROM lines l LEFT JOIN results r "
            "ON r.batch_id = l.batch_id AND r.idx = l.idx WHERE l.batch_id = ? AND l.idx >= ? AND r.idx IS NULL "
            "ORDER BY l.idx LIMIT ?", (batch_id, start, limit + len(skip)))
        return [Line(b, i, c, json.loads(body)) for b, i, c, body in rows if i not in skip][:limit]

    def record(self, batch_id: str, result: LineResult) -> bool:
        """Commit one line's result; False if the line already had one (never answered twice)."""
        return bool(self._write(_result_inserts(batch_id, [result]))[0])

    def results(self, batch_id: str) -> Iterator[LineResult]:
        """Every result, in line order, read in pages so a large batch is never held whole."""
        last = -1
        while True:
            rows = self._rows("SELECT idx, custom_id, status_code, request_id, body, error FROM results "
                              "WHERE batch_id = ? AND idx > ? ORDER BY idx LIMIT 1000", (batch_id, last))
            if not rows:
                return
            for idx, custom_id, status, request_id, body, error in rows:
                yield LineResult(idx, custom_id, status, request_id, _loads(body), _loads(error))
            last = rows[-1][0]

    def unanswered(self, batch_id: str) -> list[tuple[int, str | None]]:
        """(idx, custom_id) of the lines without a result."""
        return self._rows("SELECT l.idx, l.custom_id FROM lines l LEFT JOIN results r ON r.batch_id = l.batch_id "
                          "AND r.idx = l.idx WHERE l.batch_id = ? AND r.idx IS NULL ORDER BY l.idx", (batch_id,))

    def counts(self, batch_id: str) -> Counts:
        """Lines answered 200 and lines answered otherwise (the batch row holds the total)."""
        ok, errored = self._rows("SELECT COALESCE(SUM(status_code = 200), 0), COALESCE(SUM(status_code != 200), 0) "
                                 "FROM results WHERE batch_id = ?", (batch_id,))[0]
        return Counts(ok, errored)

    def line_states(self) -> tuple[int, int]:
        """Lines of active batches without a result, and results recorded (for /metrics)."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        pending = self._rows(
            f"SELECT COUNT(*) FROM lines l JOIN batches b ON b.id = l.batch_id WHERE b.status IN ({marks}) "
            "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.batch_id = l.batch_id AND r.idx = l.idx)",
            ACTIVE_STATUSES)[0][0]
        return pending, self._rows("SELECT COUNT(*) FROM results")[0][0]


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_insert(row: FileRow) -> tuple[str, tuple]:
    return "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", _fields(row)


def _fields(row: Any) -> tuple:
    return tuple(getattr(row, name) for name in row.__slots__)


def _batch_fields(batch: BatchRow) -> tuple:
    return tuple(json.dumps(value) if name in ("times", "metadata", "errors") else value
                 for name, value in zip(batch.__slots__, _fields(batch)))


def _batch(row: tuple) -> BatchRow:
    values = dict(zip(BatchRow.__slots__, row))
    for name in ("times", "metadata", "errors"):
        values[name] = _loads(values[name])
    return BatchRow(**values)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _line_inserts(lines: Iterable[Line]) -> Iterator[tuple[str, tuple]]:
    for line in lines:
        yield "INSERT INTO lines VALUES (?, ?, ?, ?)", (line.batch_id, line.idx, line.custom_id, json.dumps(line.body))


def _result_inserts(batch_id: str, results: Iterable[LineResult]) -> list[tuple[str, tuple]]:
    return [("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
             (batch_id, r.idx, r.custom_id, r.status_code, r.request_id,
              None if r.body is None else json.dumps(r.body), None if r.error is None else json.dumps(r.error)))
            for r in results]
