"""Who gets in and how long they may wait: the policy for queued (distributed) requests.

Three outcomes, each with the status a client can act on:

- too much outstanding work for the model (queued + in flight ≥
  ``max_inflight``): 429, retry later;
- no live worker for the model, even after waiting up to the queue timeout
  for one: 503, retry later;
- otherwise the request is prepared and submitted with ``Deadlines``.

Both refusals come before any preparation work. The fleet watcher's
snapshot (about a second old) decides at no round trip's cost while it
counts fewer outstanding requests than the bound; once it counts the bound,
a count read from Redis decides instead, so a place freed since the
snapshot is not refused. The snapshot can lag a burst, so the bound is kept
exactly where the request joins the model's shared in-flight set: its
submission checks the count and joins in one atomic step, and a request it
refuses ends with the same 429. Reserving the place in a round trip of its
own before preparation would cost each request one pass of a busy event
loop before its first token.

Every way a request can end early is an ``Error`` event with a ``kind``;
``ERROR_STATUSES`` is the one table that says which HTTP status and error type
each kind becomes, for streamed and whole responses alike.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from api.errors import ApiError
from shared.events import Error
from shared.wire import Deadlines, WorkerLoad

if TYPE_CHECKING:
    from api.settings import Settings


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


@dataclass(frozen=True, slots=True)
class Limits:
    """Admission bound and deadlines (seconds), from ``Settings``.

    ``queue_timeout_s`` bounds the wait for a worker to start the job (and,
    at admission, for a live worker to exist); ``first_token_timeout_s`` and
    ``total_timeout_s`` are counted from submission.
    """

    queue_timeout_s: float = 30.0
    first_token_timeout_s: float = 60.0
    total_timeout_s: float = 600.0
    max_inflight: int = 256

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            queue_timeout_s=settings.queue_timeout_s,
            first_token_timeout_s=settings.first_token_timeout_s,
            total_timeout_s=settings.total_timeout_s,
            max_inflight=settings.max_inflight,
        )

    def deadlines(self, start: float) -> Deadlines:
        return Deadlines(
            queue=start + self.queue_timeout_s,
            first_token=start + self.first_token_timeout_s,
            total=start + self.total_timeout_s,
        )

    def job_deadlines(self, submitted: float) -> Deadlines:
        """An async job's: a worker must start it, and end it, this long after submission."""
        return Deadlines(
            queue=submitted + self.queue_timeout_s, total=submitted + self.total_timeout_s
        )

    def adoption_deadlines(self, submitted: float) -> Deadlines:
        """An adopted job's: no queue deadline (its events may be there already), and the
        total one, but at least a queue timeout from now to show the events there are."""
        total = max(submitted + self.total_timeout_s, time.time() + self.queue_timeout_s)
        return Deadlines(total=total)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """What the workers of one model and the in-flight set said at ``taken_at``."""

    workers: tuple[WorkerLoad, ...] = ()
    outstanding: int = 0  # accepted and not finished: queued + running
    queued: int = 0  # messages in the model's queue lists, not taken by a worker yet
    taken_at: float = 0.0  # monotonic; 0 = never read

    @property
    def in_flight(self) -> int:
        """Outstanding requests a worker has taken: running, waiting or reserved.

        Not the workers' heartbeats (``running + waiting``): those count only
        what an engine holds, so they miss the jobs a worker has reserved
        and not yet started and, above all, those of a worker that died,
        which wait in no list and no heartbeat until a live worker's heartbeat
        hands them back, and are the work a replacement worker is needed for.
        Not below 0: a list can still hold the message of a request cancelled
        before any worker took it (the first worker to pop it drops it).
        """
        return max(self.outstanding - self.queued, 0)

    @property
    def live(self) -> tuple[WorkerLoad, ...]:
        """Workers that take new jobs (a draining worker only finishes what it has)."""
        return tuple(worker for worker in self.workers if not worker.draining)

    def desired_workers(self, default_capacity: int) -> int:
        """``ceil((queued + in flight) / per-worker capacity)``: the autoscaling signal.

        Not the Celery list length alone: a worker reserves (prefetches) jobs
        up to its free slots, and those leave the list while still waiting
        for the GPU, so a short list can hide a saturated fleet and an empty
        list would scale a busy fleet to zero. The per-worker capacity is the
        smallest any heartbeat reports.
        """
        capacities = [worker.capacity for worker in self.workers if worker.capacity > 0]
        per_worker = min(capacities) if capacities else default_capacity
        return math.ceil((self.queued + self.in_flight) / max(per_worker, 1))


class Admission:
    """The early admission check of one served model (see the module docstring).

    A request waits for a live worker (503 if none comes) and is refused
    (429) while ``max_inflight`` requests are outstanding: as the fleet
    watcher's snapshot counts them, without a round trip, or once that count
    reaches the bound, as ``count_outstanding`` reads them now. The bound
    itself is kept by the submission, which checks the shared in-flight set
    and joins it in one atomic step (``api.backends.request_queue``), so no
    number of API processes overshoots it; this check spares the preparation
    of requests the submission would refuse.
    """

    def __init__(
        self,
        limits: Limits,
        snapshot: Callable[[], FleetSnapshot],
        count_outstanding: Callable[[], Awaitable[int]],
        poll_s: float = 0.25,
    ) -> None:
        self._limits = limits
        self._snapshot = snapshot
        self._count_outstanding = count_outstanding
        self._poll_s = poll_s

    async def admit(self) -> None:
        """Return when a request may be prepared; raises 503 or 429 ``ApiError``s."""
        await self._wait_for_worker()
        bound = self._limits.max_inflight
        if self._snapshot().outstanding >= bound and await self._count_outstanding() >= bound:
            raise api_error("rate_limited", rate_limited_message(bound))

    async def _wait_for_worker(self) -> None:
        """Wait up to the queue timeout for a live worker heartbeat; 503 if none comes."""
        deadline = time.monotonic() + self._limits.queue_timeout_s
        while not self._snapshot().live:
            if time.monotonic() >= deadline:
                raise api_error(
                    "unavailable",
                    f"No worker is serving this model (waited "
                    f"{self._limits.queue_timeout_s:g}s for one); retry later.",
                )
            await asyncio.sleep(self._poll_s)


def rate_limited_message(max_inflight: int) -> str:
    return (
        f"Too many requests in flight for this model (the limit is {max_inflight}); "
        "retry after a short wait."
    )
