"""Responses whose client stopped reading are cancelled, so they stop costing engine time.

The server's ``send`` waits while the connection's buffers are full: a
client that stops reading a stream keeps it waiting there. A body chunk that
cannot be handed over within ``timeout_s`` ends the response (the access log
records it as a client that left), which closes its generation's events and
takes the request out of the engine.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 60.0


class StalledClient(Exception):
    """The client has not taken a chunk of the response for ``timeout_s`` seconds."""


class StallGuard:
    """ASGI middleware: a response body chunk not sent within ``timeout_s`` ends the response."""

    def __init__(self, app: ASGIApp, timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_in_time(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(self.timeout_s):
                    await send(message)
            except TimeoutError:
                raise StalledClient(f"no chunk taken for {self.timeout_s:g}s") from None

        try:
            await self.app(scope, receive, send_in_time)
        except* StalledClient as group:  # a streaming response raises it from its task group
            exc = group.exceptions[0]
            log.warning(
                "%s %s: the client stopped reading (%s); ended", scope["method"], scope["path"], exc
            )
