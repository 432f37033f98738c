"""The response every Server-Sent Events stream goes out in.

sse-starlette wraps each body send in an anyio cancel scope for its own
per-send timeout. Sluice never sets that timeout: ``StallGuard`` already
bounds every body send of every response, with one asyncio timer. The scope
still cost about a fifth of the API's CPU per streamed token, so
``SSEResponse`` sends without it. ``_send_with_timeout`` is private, hence the
pin.
"""

from __future__ import annotations

from sse_starlette import EventSourceResponse
from starlette.types import Message, Send

from shared.versions import require

require("sse-starlette")


class SSEResponse(EventSourceResponse):
    """``EventSourceResponse`` without the per-send timeout scope (``send_timeout`` is unused)."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        try:
            await send(message)
        except BaseException:
            self._send_interrupted = True  # as the library marks a send that never completed
            raise
