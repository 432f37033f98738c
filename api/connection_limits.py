"""Limits on a connection before a request exists: how long its headers may take, and their size.

uvicorn's HTTP parser (httptools) waits for headers forever and buffers them
without bound, so a client trickling a header (slowloris) or sending a 50 MB
one would hold a connection and memory. ``GuardedHttpProtocol`` is uvicorn's
httptools protocol with two checks added at the byte level, before any ASGI
code runs:

- a request's headers must be complete ``header_timeout_s`` after its first
  byte (for a new connection, after the connection opens), else the server
  answers 408 and closes the connection;
- the bytes of a request's head (request line and headers) may not pass
  ``max_header_bytes``, else the server answers 431 and closes the connection.

After either answer, the bytes the client still sends are dropped for
``LINGER_S`` before the connection closes, so the answer is not lost to a reset.

Idle keep-alive connections are closed by uvicorn's own ``timeout_keep_alive``.
The protocol builds on uvicorn's ``HttpToolsProtocol`` internals (its parser
callbacks and ``transport``), so ``pyproject.toml`` pins uvicorn to the minor
versions it was written against, and tests/e2e/test_connection_limits.py checks it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.versions import require

require("uvicorn")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
LINGER_S = 2.0  # after a refusal, how long the connection drains before it closes

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline and a size bound on each request's head."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # no complete head yet for the request being received
        self._head_bytes = 0  # bytes received while awaiting the head: bounds an endless one
        self._head_size = 0  # the parsed head's request line and headers: bounds a whole one
        self._head_deadline: asyncio.TimerHandle | None = None
        self._refused = False  # answered 408 or 431: the rest of the connection is dropped

    @classmethod
    def configured(
        cls, header_timeout_s: float, max_header_bytes: int
    ) -> type[GuardedHttpProtocol]:
        """A subclass with these limits: uvicorn builds one protocol per connection from a class."""
        limits = {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes}
        return type(cls.__name__, (cls,), limits)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_head:
            self._arm_head_deadline()  # the next request on a kept-alive connection began
            self._head_bytes += len(data)
        super().data_received(data)
        endless = self._awaiting_head and self._head_bytes > self.max_header_bytes
        if endless or self._head_size > self.max_header_bytes:
            self._refuse(431, f"The request's headers exceed {self.max_header_bytes} bytes.")

    # The parser's callbacks, called from ``data_received``.

    def on_message_begin(self) -> None:
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._disarm_head_deadline()
        if self._head_size <= self.max_header_bytes:  # else no request starts: a 431 follows
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._head_size <= self.max_header_bytes:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._head_size <= self.max_header_bytes:
            super().on_message_complete()
        self._awaiting_head, self._head_bytes = True, 0  # later bytes begin the next request

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._awaiting_head and self._head_bytes:
            late = f"The request's headers did not arrive within {self.header_timeout_s:g}s."
            self._refuse(408, late)
        elif self._awaiting_head and not self.transport.is_closing():
            self.transport.close()  # nothing was sent: there is no request to answer

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with a JSON error and close; the route (so its protocol) is unknown."""
        self._refused, self._awaiting_head = True, False
        self._disarm_head_deadline()
        if self.transport.is_closing():
            return
        kind = "request_timeout" if status == 408 else "invalid_request_error"
        body = json.dumps({"error": {"message": message, "type": kind}}).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        # Closing with unread bytes would reset the connection, which can discard the answer
        # before the client reads it: end the writing side, drop what still comes, close later.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
