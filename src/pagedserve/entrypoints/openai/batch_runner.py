"""The background task that runs stored batches: validates new ones, keeps a bounded number
of their lines in flight (batch_execution.py), commits each answer once (batch_store.py),
honours cancel and the completion window, and writes the output and error files.

A line whose answer is not its own doing (429: displaced or the queue is full; 503: the
server is shutting down) is not recorded and runs again later, as is one still in flight
when the server stops: after a restart the runner takes up every line without a result.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from .batch_execution import LineExecutor
from .batch_lines import EXPIRED_ERROR, ParsedInput, dumps, line_error, openai_line, parse_input
from .batch_store import BatchRow, BatchStore, FileRow, Line, LineResult, new_id
from .serving import Admission

logger = logging.getLogger("pagedserve.batches")

# How often the runner looks for expired batches when nothing else wakes it.
_POLL_S = 1.0
# How long after a displaced or refused line before the runner starts lines again.
_RETRY_AFTER_S = 1.0


class BatchRunner:
    def __init__(self, store: BatchStore, executor: LineExecutor, admission: Admission, max_in_flight: int):
        self.store = store
        self._executor = executor
        self._admission = admission
        self._max_in_flight = max_in_flight
        self._in_flight: dict[tuple[str, int], asyncio.Task] = {}
        self._cursor: dict[str, int] = {}  # batch id -> the lowest line index that may lack an answer
        self._wake = asyncio.Event()
        self._resume_at = 0.0

    @property
    def num_running(self) -> int:
        return len(self._in_flight)

    def wake(self) -> None:
        """Something changed (a new batch, a cancel, a line done): look again now."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled (server shutdown), which cancels the lines in flight unrecorded."""
        try:
            while True:
                self._wake.clear()
                await self.step()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _POLL_S)
        finally:
            for task in self._in_flight.values():
                task.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    async def run_until_done(self) -> None:
        """Run until no batch has work left (`pagedserve run-batch`)."""
        while self.store.active_batches():
            self._wake.clear()
            await self.step()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _POLL_S)

    async def step(self) -> None:
        """Move every active batch on, then fill the free line slots in batch order."""
        now = time.time()
        for batch in self.store.active_batches():
            if batch.status == "validating":
                await self._validate(batch)
            elif batch.status == "cancelling":
                self._stop_lines(batch.id)
                if not self._lines_of(batch.id):
                    self._finish(batch, "cancelled", ("cancelling",))
            elif batch.status == "in_progress" and now >= batch.expires_at:
                self._stop_lines(batch.id)
                self._finish(batch, "expired", ("in_progress",))
            elif batch.status == "finalizing":
                self._finish(batch, "completed", ("finalizing",))
            elif not self._lines_of(batch.id) and not self.store.pending_lines(batch.id, 1, set(), self._start(batch)):
                if self.store.set_status(batch.id, "finalizing", only_from=("in_progress",)):
                    self._finish(batch, "completed", ("finalizing",))
        self._start_lines()

    def _start_lines(self) -> None:
        if self._admission.draining or time.monotonic() < self._resume_at:
            return
        for batch in self.store.active_batches():
            room = self._max_in_flight - len(self._in_flight)
            if room <= 0:
                return
            if batch.status != "in_progress":
                continue
            for line in self.store.pending_lines(batch.id, room, self._running_lines(batch.id), self._start(batch)):
                self._in_flight[(batch.id, line.idx)] = asyncio.ensure_future(self._run_line(batch, line))
            # Every line below the lowest one in flight has its answer (lines start in order).
            self._cursor[batch.id] = min(self._running_lines(batch.id), default=self._start(batch))

    def _start(self, batch: BatchRow) -> int:
        """The lowest line index that may lack an answer (0 after a restart: one full scan)."""
        return self._cursor.get(batch.id, 0)

    def _running_lines(self, batch_id: str) -> set[int]:
        return {idx for b, idx in self._in_flight if b == batch_id}

    async def _run_line(self, batch: BatchRow, line: Line) -> None:
        try:
            answer = await self._executor.run(batch.endpoint, line.body, batch.owner)
            if answer.retry or self._admission.draining:
                self._resume_at = time.monotonic() + _RETRY_AFTER_S
                self._cursor[batch.id] = min(self._start(batch), line.idx)
                return
            self.store.record(batch.id, LineResult(line.idx, line.custom_id, answer.status_code,
                                                   new_id("batch_req_"), answer.body))
        finally:
            self._in_flight.pop((batch.id, line.idx), None)
            self.wake()

    def _lines_of(self, batch_id: str) -> list[asyncio.Task]:
        return [task for (b, _), task in self._in_flight.items() if b == batch_id]

    def _stop_lines(self, batch_id: str) -> None:
        for task in self._lines_of(batch_id):
            task.cancel()

    async def _validate(self, batch: BatchRow) -> None:
        path = self.store.file_path(batch.input_file_id or "")
        try:
            parsed = await asyncio.to_thread(_parse_file, batch, path)
        except FileNotFoundError:
            self.store.set_status(batch.id, "failed", only_from=("validating",), errors=[{
                "code": "input_file_missing", "line": None, "param": "input_file_id",
                "message": f"the input file {batch.input_file_id} was deleted before the batch was validated"}])
            return
        if parsed.errors:
            self.store.set_status(batch.id, "failed", only_from=("validating",), errors=parsed.errors)
            return
        self.store.start_batch(batch.id, parsed.lines, parsed.early)
        logger.info("batch %s: %d lines to run, %d refused", batch.id, len(parsed.lines), len(parsed.early))

    def _finish(self, batch: BatchRow, status: str, only_from: tuple[str, ...]) -> None:
        """The final status; an OpenAI batch's output and error files written first."""
        files = {}
        if batch.api == "openai":
            expired = status == "expired"
            files = {"output_file_id": self._output_file(batch, "output", self._openai_lines(batch, True, False)),
                     "error_file_id": self._output_file(batch, "error", self._openai_lines(batch, False, expired))}
        if self.store.finish_batch(batch.id, status, files, only_from):
            logger.info("batch %s %s", batch.id, status)

    def _openai_lines(self, batch: BatchRow, succeeded: bool, expired: bool) -> Iterator[str]:
        for result in self.store.results(batch.id):
            if (result.status_code == 200) == succeeded:
                yield dumps(openai_line(result))
        if expired:
            for idx, custom_id in self.store.unanswered(batch.id):
                yield dumps(openai_line(line_error(idx, custom_id, EXPIRED_ERROR["code"], EXPIRED_ERROR["message"])))

    def _output_file(self, batch: BatchRow, kind: str, lines: Iterator[str]) -> FileRow | None:
        first = next(lines, None)
        if first is None:
            return None  # as OpenAI: no file when no line goes in it
        return self.store.stage_file(batch.owner, "batch_output", f"{batch.id}_{kind}.jsonl",
                                     _chain(first, lines))


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _parse_file(batch: BatchRow, path: Path) -> ParsedInput:
    with open(path, "rb") as f:
        return parse_input(batch.id, (batch.endpoint,), f)
