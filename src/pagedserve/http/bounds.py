"""Bounds on what a client may make the HTTP server hold before a request reaches the app.

uvicorn's httptools protocol reads a request's header block whole, with no limit on its
size and no deadline: one 500 MB header was read into memory and answered 200 (the class
of vLLM's CVE-2025-48956), and a socket trickling a header byte now and then was held
forever (slow-loris). `limited_http_protocol` returns that protocol with both bounds: a
header block past `max_header_bytes` gets 431 and the connection closes, without reading
the rest; one not complete `header_timeout_s` after its first byte (or after the connection
opened) gets 408 and the connection closes. The app's own body limit
(BodyLimitMiddleware) covers what follows the headers.
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_HEADER_TIMEOUT_S = 15.0

_REASONS = {408: (b"Request Timeout", "request_timeout"),
            431: (b"Request Header Fields Too Large", "request_header_fields_too_large")}


def _error_response(status: int, message: str) -> bytes:
    # The API's error shape (http/errors.APIError), written by hand: the
    # request never reached the app.
    reason, code = _REASONS[status]
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (status, reason), b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


def limited_http_protocol(max_header_size: int = DEFAULT_MAX_HEADER_BYTES,
                          header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these bounds (pass it as uvicorn.Config(http=...)).
    uvicorn is imported here, so the CLI's parser can read the defaults without it."""
    if max_header_size < 1 or not header_timeout > 0:
        raise ValueError(f"max_header_size must be >= 1 and header_timeout > 0, got {max_header_size}, "
                         f"{header_timeout}")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        max_header_bytes = max_header_size
        header_timeout_s = header_timeout

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_bytes = 0
            self._in_headers = True
            self._refused = False
            self._header_timer: asyncio.TimerHandle | None = None
            self._start_header_timer()

        def _start_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, status: int, message: str) -> None:
            self._refused = True
            self._stop_header_timer()
            self.transport.write(_error_response(status, message))
            self.transport.close()

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self._in_headers and not self.transport.is_closing():
                self._refuse(408, f"the request's headers did not arrive within {self.header_timeout_s:g} s")

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self.transport.is_closing():  # a request the parser refused (400)
                return
            # Everything fed while the header block is still open was header bytes; a chunk that
            # completed it may hold body bytes too, which the app's body limit counts instead.
            if self._in_headers and not self._refused:
                self._header_bytes += len(data)
                if self._header_bytes > self.max_header_bytes:
                    self._refuse(431, f"the request's headers exceed {self.max_header_bytes} bytes "
                                      "(--max-header-size)")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = 0
            self._start_header_timer()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._stop_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

    return LimitedHttpToolsProtocol
