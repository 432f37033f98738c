"""Request ids and the access log: one line per request, and the request count by outcome.

Every response carries ``x-request-id``: the client's own when it sent a
well-formed one (letters, digits, ``._:-``, up to 128), else a new
``req_…``. When the request ends (the last byte sent, or the client gone)
its admission is released and one line is logged under ``sluice.access``
with the id, the key's name (never the key), the protocol, the model, the
status, the token counts, the time to first token and the duration. A
response whose client left before its end (a stream it stopped reading, a
whole response it did not wait for) is recorded as 499, in the log and in
``sluice_requests``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.backends.base import Place
from api.metrics import ServingMetrics
from api.protocols.table import BY_PATH, route_path

if TYPE_CHECKING:
    from api.rate_limits import RateLimitTicket
from api.streaming import StreamProcessor

log = logging.getLogger("sluice.access")

REQUEST_ID_HEADER = "x-request-id"
CLIENT_LEFT = 499
# Polled by orchestrators and Prometheus: their successful answers are logged at DEBUG.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
_WELL_FORMED = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(slots=True)
class AccessRecord:
    """What the access log knows of a request: its protocol by path, the rest from its route."""

    protocol: str | None = None
    model: str | None = None
    response_id: str | None = None  # the generation's id: the one the workers' lines name
    processor: StreamProcessor | None = None  # its usage, once the response ends
    first_token_at: float | None = None
    place: Place | None = None  # its admission, released when the request ends
    rate_limits: RateLimitTicket | None = None  # its key's share, given back when it ends


def request_id_of(headers: Headers) -> str:
    """The client's ``x-request-id`` when well-formed, else a fresh one."""
    sent = headers.get(REQUEST_ID_HEADER, "")
    return sent if _WELL_FORMED.fullmatch(sent) else "req_" + secrets.token_hex(12)


class AccessLog:
    """ASGI middleware: the request id, the access line and the request count."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(Headers(scope=scope))
        record = AccessRecord()
        state = scope.setdefault("state", {})
        state["request_id"], state["access"] = request_id, record
        protocol = BY_PATH.get(route_path(scope))
        record.protocol = protocol.name if protocol is not None else None
        started = time.monotonic()
        status, ended = 500, False

        async def send_with_id(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
                if record.place is not None:  # free before the client can send its next request
                    record.place.release()
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if record.place is not None:
                record.place.release()
            if record.rate_limits is not None:
                usage = record.processor.usage if record.processor is not None else None
                used = usage.total_tokens if usage is not None else 0
                await asyncio.shield(record.rate_limits.release(used))
            outcome = status if ended else CLIENT_LEFT
            if record.protocol is not None:
                self.metrics.count_request(record.protocol, outcome)
            self._log(scope, state, record, outcome, started)

    @staticmethod
    def _log(scope: Scope, state: dict, record: AccessRecord, status: int, started: float) -> None:
        usage = record.processor.usage if record.processor is not None else None
        ttft = (
            f"{(record.first_token_at - started) * 1000:.0f}"
            if record.first_token_at is not None
            else "-"
        )
        quiet = route_path(scope) in PROBE_PATHS and status < 400  # a probe's answer is routine
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s %s %s response=%s key=%s protocol=%s model=%s status=%d prompt_tokens=%s "
            "completion_tokens=%s ttft_ms=%s duration_ms=%.0f",
            state["request_id"],
            scope["method"],
            scope["path"],
            record.response_id or "-",
            state.get("api_key") or "-",
            record.protocol or "-",
            record.model or "-",
            status,
            usage.prompt_tokens if usage else "-",
            usage.completion_tokens if usage else "-",
            ttft,
            (time.monotonic() - started) * 1000,
        )
