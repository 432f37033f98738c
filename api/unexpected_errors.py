"""Any exception a route lets escape is answered, in the protocol's shape, on the same connection.

Starlette answers an exception no handler took with its 500 page and then
raises it again for the server to log; the server then closes the connection
under the response, and a client reusing that connection can read a reset
instead of the answer. This middleware sits right around the routes: it
renders the exception (``render``: a store failure is a 503, anything else a
500) before a response has started and keeps it from going further, so the
access log records the status and the connection stays usable. After a
response has started (a stream) there is no answer left to give; the
exception goes on and the connection is cut, the only way left to say so.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class UnexpectedErrors:
    """ASGI middleware: an escaping exception becomes ``render(request, exc)``'s response."""

    def __init__(self, app: ASGIApp, render: Callable[[Request, Exception], Response]) -> None:
        self.app = app
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_start)
        except Exception as exc:
            if started:
                raise
            await self.render(Request(scope, receive), exc)(scope, receive, send)
