"""A job's generation on the workers (distributed mode), owned by the job, not by a process.

Why jobs do not run through ``DistributedBackend.infer``: a synchronous
request's generation belongs to the HTTP response reading it, so the
backend cancels it whenever its reader ends without a ``Finish``, the
API's own shutdown included. A job's generation must outlive the API
process that submitted it. So jobs are put on the model's queue here (the
same Celery task, queue, in-flight set and seeding as the backend), and
their events are read from the request's Redis Stream by whichever process
holds the job's lease: the submitter first, an adopter after a restart.
Both read from the stream's start through the live path's own
``EventReader``, so a replay sees exactly the events, and the fencing, the
first reader saw.

``events`` ends after a ``Finish`` or ``Error``. Closing it earlier, or an
``Error``, cancels the request on the workers (cancel flag and channel of
``shared.keys``), except once ``stopping`` is set: the process is going
away and the generation goes on for the job's next runner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.backends.event_reader import EventReader
from api.backends.job_queue import JobQueue, with_seed
from api.errors import ApiError
from shared import keys
from shared.events import Error, Finish, InferenceEvent
from shared.wire import Deadlines, Job, PreparedRequest

if TYPE_CHECKING:
    from api.settings import Settings

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 5.0


class WorkerQueue:
    """Submits, reads and cancels job generations; see the module docstring."""

    def __init__(self, redis_url: str, settings: Settings) -> None:
        self._queue_timeout_s = settings.queue_timeout_s
        self._total_timeout_s = settings.total_timeout_s
        self._redis = Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2
        )
        self._reader = EventReader(redis_url)
        self._queue = JobQueue(self._redis)
        self.stopping = False

    async def start(self) -> None:
        await self._reader.start()

    async def close(self) -> None:
        """Stop reading (open readers end, cancelling nothing once ``stopping``)."""
        await self._reader.stop()
        await self._redis.aclose()

    def deadlines(self, submitted: float) -> Deadlines:
        """A worker must start the job, and end it, this long after its submission."""
        return Deadlines(
            queue=submitted + self._queue_timeout_s, total=submitted + self._total_timeout_s
        )

    def adoption_deadlines(self, submitted: float) -> Deadlines:
        """For a replay: no queue deadline (events may be there already), and the total
        deadline, but at least a queue timeout from now to show the events there are."""
        total = max(submitted + self._total_timeout_s, time.time() + self._queue_timeout_s)
        return Deadlines(total=total)

    async def submit(self, request: PreparedRequest, deadlines: Deadlines) -> None:
        """Join the model's in-flight set and queue the request; a 503 if Redis refuses."""
        request = with_seed(request)
        score = deadlines.total or time.time() + self._total_timeout_s
        try:
            await self._queue.put(Job(request, deadlines), score)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("queueing %s failed: %s", request.request_id, exc)
            message = "Could not queue the job: Redis is unreachable; retry later."
            raise ApiError(503, message, "overloaded_error", headers={"Retry-After": "2"}) from exc

    async def events(
        self, request: PreparedRequest, deadlines: Deadlines
    ) -> AsyncIterator[InferenceEvent]:
        """The request's events from the first, with timeout errors at its deadlines."""
        request_id = request.request_id
        subscription = self._reader.open(request_id)
        started, last = False, None
        try:
            while not isinstance(last, Finish | Error):
                deadline, kind = _pending(deadlines, started)
                try:
                    async with asyncio.timeout(
                        None if deadline is None else deadline - time.time()
                    ):
                        last = await subscription.events.get()
                except TimeoutError:
                    last = Error(request_id, _timeout_message(kind), kind)
                started = True
                yield last
        finally:
            self._reader.close(request_id)
            if not self.stopping:
                with anyio.CancelScope(shield=True):
                    await self._end(request, cancel=not isinstance(last, Finish))

    async def cancel(self, request_id: str) -> None:
        """Ask the workers to stop ``request_id``; one that has not started it drops it."""
        await self._signal(request_id, None)

    async def _end(self, request: PreparedRequest, *, cancel: bool) -> None:
        """Leave the in-flight set; cancel a generation that did not finish."""
        await self._signal(request.request_id if cancel else None, request)

    async def _signal(self, cancel: str | None, done: PreparedRequest | None) -> None:
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                async with self._redis.pipeline(transaction=False) as pipe:
                    if cancel is not None:
                        pipe.set(keys.cancel_flag(cancel), "1", ex=keys.FINISHED_STREAM_TTL_S)
                        pipe.publish(keys.CANCEL_CHANNEL, cancel)
                    if done is not None:
                        pipe.zrem(keys.inflight(done.model), done.request_id)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:  # in-flight scores expire anyway
            log.warning("signalling the workers failed: %s", exc)


def _pending(deadlines: Deadlines, started: bool) -> tuple[float | None, str]:
    """The deadline that applies now: the queue one until the first event, then the total."""
    if not started and deadlines.queue is not None:
        return deadlines.queue, "queue_timeout"
    return deadlines.total, "total_timeout"


def _timeout_message(kind: str) -> str:
    if kind == "queue_timeout":
        return "No worker started the job before its queue deadline; the workers are busy."
    return "The generation did not finish before its deadline."


__all__ = ["WorkerQueue"]
