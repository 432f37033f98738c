"""One request channel per API process: submit, events, deadlines and ends, over Redis.

Every generation this process hands to workers goes through here: the
distributed backend's requests and async jobs queue the same way
(``api.backends.request_queue``), read their events through the one
``EventReader``, meet their deadlines with the same messages and end the
same way. A request's stream is ``attached`` (leaving it early cancels the
generation); a job's is not once the channel is stopping (the process goes
away, and the job's next runner follows it).

Ending a generation leaves the model's in-flight set and, unless it ended
with a ``Finish``, cancels it and withdraws its message if no worker took
it. The end runs as a task of its own, so it completes even when its reader
is being cancelled; one that finds Redis unreachable is sent again once
Redis answers. A generation's last event waits for its end, so a client that
sends its next request on seeing it finds its place free. A job goes to the
queue its model's ``Placer`` chooses (``api.backends.placement``), the shared
one when it has none. The channel renews this process's origin key every
second (``keys.api_process``): workers stop the requests of a process whose
key expired. Unseeded sampling requests get a seed at submission, so a
resumed stream draws what the first attempt would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from api.backends.event_reader import EventReader, Subscription
from api.backends.placement import SHARED, Placer
from api.backends.request_queue import RequestQueue, with_seed, withdraw
from api.error_kinds import rate_limited_message
from api.limits import Limits
from shared import keys
from shared.events import Error, Finish, InferenceEvent, Text
from shared.task_message import TaskMessage
from shared.wire import Deadlines, QueuedRequest

if TYPE_CHECKING:
    from api.rate_limits import RateLimitTicket

log = logging.getLogger(__name__)

RENEW_S = 1.0  # the origin key's renewal and the resending of unsent ends
CLEANUP_TIMEOUT_S = 5.0
MAX_UNSENT_ENDS = 10_000  # kept for when Redis answers again; older ones are let go


def _raise_a_dropped_cancel() -> None:
    """Raise the cancel a call returned through without raising.

    Python 3.11's ``asyncio.wait_for``, which redis-py sends every command through, returns
    the result to a task cancelled as the result arrived and drops the cancel (fixed in
    3.12); the task still counts it (``Task.cancelling``). A client that left during the
    submission would otherwise be followed to the queue deadline, its job run for nobody.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class RequestChannel:
    """Submits, follows and ends generations on the workers; see the module docstring."""

    def __init__(self, redis_url: str, limits: Limits) -> None:
        self.limits = limits
        self.redis = Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2
        )
        self.reader = EventReader(redis_url)
        self.process_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.stopping = False  # the process is going away: detached generations go on
        self._queue = RequestQueue(self.redis)
        self.placers: dict[str, Placer] = {}  # by model; a model without one: the shared queue
        self._users = 0
        self._tasks: set[asyncio.Task[Any]] = set()  # ends in progress
        self._unsent_ends: dict[str, _End] = {}  # request id -> an end Redis did not receive
        self._renewer: asyncio.Task[None] | None = None

    # --- lifecycle: shared by the backend and the jobs manager ---------------------------

    async def start(self) -> None:
        """Start reading and renewing; a second user only counts itself in."""
        self._users += 1
        if self._users > 1:
            return
        self.stopping = False
        await self.reader.start()
        try:  # before any job names this process
            await self._renew_origin()
        except (RedisError, OSError) as exc:
            log.warning("could not announce this API process in Redis: %s", exc)
        self._renewer = asyncio.create_task(self._renew(), name="sluice-channel-renewer")

    async def stop(self) -> None:
        """Once its last user stops: stop reading (open streams end with an ``Error``).

        Ends in progress get a moment to finish; nothing here waits on Redis
        without a limit (a cancelled call can hang in redis-py).
        """
        self._users = max(self._users - 1, 0)
        if self._users > 0:
            return
        self.stopping = True
        await self.reader.stop()
        await asyncio.sleep(0)  # the streams the reader just ended spawn their ends
        deadline = time.monotonic() + CLEANUP_TIMEOUT_S
        while self._tasks and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(self._tasks), timeout=left)
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.wait([self._renewer], timeout=1.0)
            self._renewer = None
        await self.redis.aclose()

    # --- one generation ------------------------------------------------------------------

    def request(
        self, job: QueuedRequest, bound: int | None, ticket: RateLimitTicket | None = None
    ) -> AsyncIterator[InferenceEvent]:
        """Submit ``job`` (refused beyond ``bound`` outstanding) and yield its events to its end.

        The generation is attached: leaving early cancels it, whatever the reason.
        ``ticket``: its key's share, taken in the submission's script; a refusal
        raises the ticket's 429 before any event.
        """
        job = dataclasses.replace(job, request=with_seed(job.request))
        return self._run(job, None, bound, ticket, attached=True)

    async def submit(self, job: QueuedRequest) -> tuple[QueuedRequest, TaskMessage | Error]:
        """Queue a detached ``job`` with no bound (a job accepted is queued), seeded as sent."""
        job = dataclasses.replace(job, request=with_seed(job.request))
        return job, await self._submit(job, None, None, None)

    def follow(
        self, job: QueuedRequest, queued: TaskMessage | None = None
    ) -> AsyncIterator[InferenceEvent]:
        """Yield the events of a detached job, queued already, from the first to its end.

        ``queued``: its message, withdrawn if the job ends before a worker took it.
        """
        return self._run(job, queued, None, None, attached=False)

    async def cancel(self, request_id: str) -> None:
        """Ask the workers to stop ``request_id``; one that has not started it drops it."""
        await self._send_end(request_id, self._end(cancel=True, untaken=None, model=""))

    async def _run(
        self,
        job: QueuedRequest,
        queued: TaskMessage | None,
        bound: int | None,
        ticket: RateLimitTicket | None,
        *,
        attached: bool,
    ) -> AsyncIterator[InferenceEvent]:
        """One generation's events to its end; an attached one is submitted here first."""
        request_id = job.request.request_id
        subscription = self.reader.open(
            request_id, interrupt=not attached
        )  # the submit interrupts its read
        progress = _Progress()
        last: InferenceEvent | Error | None = None
        ending: asyncio.Task[None] | None = None
        try:
            if attached:
                submitted = await self._submit(job, bound, self.reader.take_interrupt(), ticket)
                _raise_a_dropped_cancel()
                if isinstance(submitted, Error):
                    last = submitted
                    yield last
                    return
                queued = submitted
            while True:
                last = await self._next_event(subscription, job.deadlines, progress)
                if isinstance(last, Finish | Error):
                    break
                yield last
            if attached or not self.stopping:  # the place is free before the client sees the
                ending = self._spawn_end(job, queued, last, progress)  # end, for its next request
                await asyncio.shield(ending)
            yield last
        finally:
            self.reader.close(request_id)
            if ending is None and (attached or not self.stopping):
                self._spawn_end(job, queued, last, progress)

    async def _submit(
        self,
        job: QueuedRequest,
        bound: int | None,
        interrupt: str | None,
        ticket: RateLimitTicket | None,
    ) -> TaskMessage | Error:
        """Join the in-flight set and queue the job: its message, or the ``Error`` that ends it.

        With a ``ticket``, the same script takes its key's share first; the
        ticket's 429 is raised if the key's limits refuse it.
        """
        request_id, limits = job.request.request_id, self.limits
        share = ticket.share if ticket is not None else None
        placer = self.placers.get(job.request.model)
        request = job.request
        spans = [image.span for image in request.images]
        placement = await placer.place(request.prompt_token_ids, spans) if placer else SHARED
        try:
            score = job.deadlines.total or time.time() + limits.total_timeout_s
            submission = await self._queue.put(job, score, bound, interrupt, share, placement)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("submitting %s failed: %s", request_id, exc)
            message = "Could not queue the request: Redis is unreachable; retry later."
            return Error(request_id, message, "unavailable")
        if ticket is not None and submission.verdict is not None:
            ticket.take(submission.verdict)  # raises the 429 when the key's limits refused
        if submission.message is None:
            return Error(request_id, rate_limited_message(bound or 0), "rate_limited")
        return submission.message

    async def _next_event(
        self, subscription: Subscription, deadlines: Deadlines, progress: _Progress
    ) -> InferenceEvent:
        """The next event, or a timeout ``Error`` once the pending deadline has passed."""
        deadline, kind = deadlines.pending(progress.started, progress.first_token)
        try:
            async with asyncio.timeout(None if deadline is None else deadline - time.time()):
                event = await subscription.events.get()
        except TimeoutError:
            return Error(subscription.request_id, self._timeout_message(kind), kind)
        progress.saw(event)
        return event

    def _timeout_message(self, kind: str) -> str:
        limits = self.limits
        return {
            "queue_timeout": f"No worker started the request within {limits.queue_timeout_s:g}s; "
            "the model's workers are busy, retry later.",
            "first_token_timeout": "The model produced no token within "
            f"{limits.first_token_timeout_s:g}s.",
            "total_timeout": f"The generation did not finish within {limits.total_timeout_s:g}s.",
        }[kind]

    # --- ends -------------------------------------------------------------------------------

    def _end(self, cancel: bool, untaken: TaskMessage | None, model: str) -> _End:
        """An end, kept for a retry until every deadline of its request has passed."""
        return _End(cancel, untaken, model, time.monotonic() + self.limits.total_timeout_s + 60)

    def _spawn_end(
        self,
        job: QueuedRequest,
        queued: TaskMessage | None,
        last: InferenceEvent | Error | None,
        progress: _Progress,
    ) -> asyncio.Task[None]:
        untaken = queued if not progress.started else None
        end = self._end(not isinstance(last, Finish), untaken, job.request.model)
        task = asyncio.get_running_loop().create_task(self._send_end(job.request.request_id, end))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _send_end(self, request_id: str, end: _End) -> None:
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                async with self.redis.pipeline(transaction=False) as pipe:
                    await self._queue_end(pipe, request_id, end)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("ending %s in Redis failed, to retry: %s", request_id, exc)
            self._unsent_ends[request_id] = end
            if len(self._unsent_ends) > MAX_UNSENT_ENDS:  # a long outage under load
                del self._unsent_ends[next(iter(self._unsent_ends))]  # the oldest

    async def _queue_end(self, pipe: Pipeline, request_id: str, end: _End) -> None:
        if end.cancel:
            ttl = math.ceil(self.limits.total_timeout_s) + 60
            pipe.set(keys.cancel_flag(request_id), "1", ex=ttl)
            pipe.publish(keys.CANCEL_CHANNEL, request_id)
            if end.untaken is not None:
                await withdraw(pipe, end.untaken)
        if end.model:
            pipe.zrem(keys.inflight(end.model), request_id)

    async def _renew(self) -> None:
        """Every second: renew this process's origin key, send the ends Redis did not take."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await self._renew_origin()
                await self._send_unsent_ends()
            except (RedisError, OSError) as exc:
                log.debug("renewing the origin key failed: %s", exc)
            except Exception:  # a dead renewer would let workers drop this process's jobs
                log.exception("the channel's renewal failed")

    async def _renew_origin(self) -> None:
        await self.redis.set(keys.api_process(self.process_id), "1", ex=keys.API_PROCESS_TTL_S)

    async def _send_unsent_ends(self) -> None:
        """Send the ends that found Redis unreachable; those past any deadline are dropped."""
        now = time.monotonic()
        pending = [(rid, end) for rid, end in self._unsent_ends.items() if end.until > now]
        self._unsent_ends = dict(pending)  # ends failing while these are sent join them
        if not pending:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id, end in pending:
                await self._queue_end(pipe, request_id, end)
            await pipe.execute()
        for request_id, _ in pending:  # the bound may have let some go meanwhile
            self._unsent_ends.pop(request_id, None)
        log.info("sent the ends of %d requests once Redis answered again", len(pending))


class _End(NamedTuple):
    """What ending a request in Redis does, kept for a retry."""

    cancel: bool
    untaken: TaskMessage | None  # its message, withdrawn if no worker took it
    model: str  # whose in-flight set it leaves ("": none, a bare cancel)
    until: float  # monotonic: past it every deadline has passed and a worker stopped anyway


@dataclasses.dataclass(slots=True)
class _Progress:
    """How far a request got, which decides the deadline that applies next."""

    started: bool = False  # any event: a worker took the job
    first_token: bool = False

    def saw(self, event: InferenceEvent) -> None:
        self.started = True
        self.first_token = self.first_token or (isinstance(event, Text) and bool(event.token_ids))
