"""A multipart/form-data upload read as it streams in: the file part written to a sink as
its bytes arrive, the small text fields kept, the file's size capped while it is read
(413 the moment it passes the cap). Memory stays at one network chunk plus a boundary."""
from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import BinaryIO

from .errors import APIError

_MAX_FIELD_BYTES = 4096
_MAX_HEADER_BYTES = 16384
_MAX_PARTS = 16
_PARAM = re.compile(r'(\w+)="([^"]*)"')


@dataclass(slots=True)
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # None: the body had no file part
    file_bytes: int = 0


def boundary_of(content_type: str) -> bytes:
    """The boundary of a multipart/form-data Content-Type; 400 for any other body."""
    kind, _, params = content_type.partition(";")
    match = re.search(r'boundary="?([^";]+)"?', params)
    if kind.strip().lower() != "multipart/form-data" or match is None:
        raise APIError(400, "the body must be multipart/form-data with a boundary (a file and its purpose)")
    return match.group(1).encode("latin-1")


class _Parser:
    def __init__(self, boundary: bytes, sink: BinaryIO, file_field: str, max_file_bytes: int):
        self.delimiter = b"\r\n--" + boundary
        self.sink = sink
        self.file_field = file_field
        self.max_file_bytes = max_file_bytes
        self.upload = Upload()
        # The body's first boundary has no CRLF before it; pretend it had.
        self.buffer = b"\r\n"
        self.state = "preamble"
        self.part: str | None = None  # the field being read; file_field for the file
        self.parts = 0

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while self.state != "done" and self._advance():
            pass

    def _advance(self) -> bool:
        """Consume what the buffer allows in the current state; False when it needs more bytes."""
        if self.state in ("preamble", "body"):
            at = self.buffer.find(self.delimiter)
            keep = len(self.delimiter) - 1
            if at < 0:
                if len(self.buffer) > keep:
                    self._emit(self.buffer[:-keep])
                    self.buffer = self.buffer[-keep:]
                return False
            self._emit(self.buffer[:at])
            self.buffer = self.buffer[at + len(self.delimiter):]
            self.state = "delimited"
            return True
        if self.state == "delimited":
            if len(self.buffer) < 2:
                return False
            mark, self.buffer = self.buffer[:2], self.buffer[2:]
            if mark == b"--":
                self.state = "done"
                return False
            if mark != b"\r\n":
                raise APIError(400, "the multipart body is malformed (bad boundary line)")
            self.state = "headers"
            return True
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEADER_BYTES:
                raise APIError(400, "a multipart part's headers are too long")
            return False
        self._start_part(self.buffer[:end].decode("latin-1"))
        self.buffer = self.buffer[end + 4:]
        self.state = "body"
        return True

    def _start_part(self, headers: str) -> None:
        self.parts += 1
        if self.parts > _MAX_PARTS:
            raise APIError(400, f"the multipart body has more than {_MAX_PARTS} parts")
        params: dict[str, str] = {}
        for line in headers.split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-disposition":
                params = dict(_PARAM.findall(value))
        self.part = params.get("name")
        if self.part == self.file_field:
            if self.upload.filename is not None:
                raise APIError(400, f"the body has more than one {self.file_field!r} part", param=self.file_field)
            self.upload.filename = params.get("filename") or "upload.jsonl"
        elif self.part is not None:
            self.upload.fields[self.part] = ""

    def _emit(self, data: bytes) -> None:
        if self.state != "body" or not data or self.part is None:
            return
        if self.part == self.file_field:
            self.upload.file_bytes += len(data)
            if self.upload.file_bytes > self.max_file_bytes:
                raise APIError(413, f"the file is over the limit of {self.max_file_bytes} bytes",
                               param=self.file_field, code="file_too_large")
            self.sink.write(data)
            return
        value = self.upload.fields[self.part] + data.decode("utf-8", errors="replace")
        if len(value) > _MAX_FIELD_BYTES:
            raise APIError(400, f"the form field {self.part!r} is too long", param=self.part)
        self.upload.fields[self.part] = value


async def read_upload(chunks: AsyncIterator[bytes], boundary: bytes, sink: BinaryIO, *, file_field: str = "file",
                      max_file_bytes: int) -> Upload:
    """Stream a multipart body: the `file_field` part into `sink` (at most `max_file_bytes`,
    else 413 at once), the other parts as text fields."""
    parser = _Parser(boundary, sink, file_field, max_file_bytes)
    async for chunk in chunks:
        parser.feed(chunk)
        if parser.state == "done":
            break
    if parser.state != "done":
        raise APIError(400, "the multipart body ended before its closing boundary")
    return parser.upload
