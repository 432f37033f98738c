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

How a refusal is answered is ``api.error_kinds``; the bound and deadlines are
``api.limits``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from api.backends.fleet_snapshot import FleetSnapshot
from api.error_kinds import api_error, rate_limited_message
from api.limits import Limits


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
