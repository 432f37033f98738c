"""How a request that ends early is answered: every way is an ``Error`` event with a
``kind``, and ``ERROR_STATUSES`` is the one table that says which HTTP status and error type
each kind becomes, for streamed and whole responses alike."""

from __future__ import annotations

from dataclasses import dataclass

from api.errors import ApiError
from shared.events import Error


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    """How one ``Error.kind`` is answered: status, error type, and ``Retry-After`` seconds."""

    status: int
    type: str
    retry_after: int | None = None


ERROR_STATUSES: dict[str, ErrorStatus] = {
    # The client sent something the engine cannot run (too long for a worker's context).
    "invalid_request": ErrorStatus(400, "invalid_request_error"),
    # Too much outstanding work for the model: the client should slow down.
    "rate_limited": ErrorStatus(429, "rate_limit_exceeded", retry_after=1),
    # The server is shutting down or a backend is saturated: another try may land elsewhere.
    "overloaded": ErrorStatus(503, "overloaded_error", retry_after=1),
    # No live worker, or Redis unreachable: nothing can run the request right now.
    "unavailable": ErrorStatus(503, "overloaded_error", retry_after=2),
    # No worker started the job before its queue deadline: the fleet is behind.
    "queue_timeout": ErrorStatus(503, "overloaded_error", retry_after=5),
    # A worker took the job but the generation ran out of time: retrying may not help.
    "first_token_timeout": ErrorStatus(504, "timeout_error"),
    "total_timeout": ErrorStatus(504, "timeout_error"),
}
_UNKNOWN_KIND = ErrorStatus(500, "api_error")


def api_error(kind: str, message: str) -> ApiError:
    """The ``ApiError`` an ``Error`` event of ``kind`` is answered with."""
    status = ERROR_STATUSES.get(kind, _UNKNOWN_KIND)
    headers = {"Retry-After": str(status.retry_after)} if status.retry_after else None
    code = "rate_limit_exceeded" if kind == "rate_limited" else None
    return ApiError(status.status, message, status.type, code=code, headers=headers)


def error_for(event: Error) -> ApiError:
    return api_error(event.kind, event.message)


def rate_limited_message(max_inflight: int) -> str:
    return (
        f"Too many requests in flight for this model (the limit is {max_inflight}); "
        "retry after a short wait."
    )
