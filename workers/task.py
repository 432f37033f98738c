"""The ``sluice.generate`` task: one job, from its message to its ack.

The task thread finds the job started (its attempt taken, what earlier
attempts already streamed read) by the script that took its message
(``workers.broker.taken``), and either answers without the engine
(cancelled, past its queue deadline, already finished) or hands a ``Run``
to the engine host and waits for its outcome. Returning acks the
message; ``Reject(requeue=True)`` puts it back in its queue for another
worker to resume.

A job handed back mid-generation (a drain, or Redis refusing its events)
goes back first in line: the task pushes it to the head of its queue,
deleting the old message's taken record in the same transaction, and acks
the old message. Celery's own requeue (``Reject(requeue=True)``) puts it at
the tail, where a client whose stream is already running would wait behind
every job queued since; it remains the fallback when the push fails. The
ack may not land before the worker exits (a drain ends the worker as its
tasks return); the record is gone already, so the job is not restored a
second time when the worker is found gone.

Deadlines are the job's own, not Celery's (``workers.broker.app.ResumableRequest``):
the task applies the queue deadline itself, to jobs that have not started.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Reject

from shared import keys
from shared.event_codec import decode_entry
from shared.events import Error, Finish, FinishReason, InferenceEvent, Ready, Text
from shared.task_message import task_message
from shared.wire import QueuedRequest, decode_queued, queued_request_id
from workers.broker.app import ResumableRequest
from workers.broker.taken import TakenStart, TakenStarts
from workers.host import Outcome, Resume, Run, WorkerHost
from workers.publisher import Batch, EventPublisher

log = logging.getLogger(__name__)

REQUEUED = (Outcome.HANDED_BACK, Outcome.UNPUBLISHED)


@dataclass(slots=True)
class TaskContext:
    """What every task of a worker shares."""

    client: redis.Redis
    publisher: EventPublisher
    host: WorkerHost
    model: str  # the registry name this worker serves
    taken_key: str  # this worker's taken records (``keys.taken``)
    starts: TakenStarts = field(default_factory=TakenStarts)  # made by the take script


@dataclass(slots=True)
class History:
    """What a request's stream already holds, from earlier attempts."""

    started: bool = False  # a Ready was written
    finished: bool = False  # a Finish or Error was written
    token_ids: list[int] = field(default_factory=list)
    chars: int = 0

    @classmethod
    def read(cls, request_id: str, entries: list[tuple[Any, dict[Any, Any]]]) -> History:
        history = cls()
        for _, fields in entries:
            history.add(decode_entry(request_id, fields).event)
        return history

    def add(self, event: InferenceEvent) -> None:
        if isinstance(event, Ready):
            self.started = True
        elif isinstance(event, Text):
            self.token_ids += event.token_ids
            self.chars += len(event.text)
        elif isinstance(event, Finish | Error):
            self.finished = True

    @property
    def trimmed(self) -> bool:
        """Tokens without a Ready before them: ``MAXLEN ~`` cut the stream's start."""
        return bool(self.token_ids) and not self.started


class StartFailed(Exception):
    """A job cannot start: its start is missing, or what earlier attempts wrote is unreadable."""


@dataclass(frozen=True, slots=True)
class Start:
    """Where a job's attempt starts: its number, whether to drop it, the stream so far."""

    attempt: int
    cancelled: bool  # its cancel flag is set, or the API process waiting for it is gone
    history: History
    delivery_tag: str  # its message's taken record


def register_task(app: Celery, context: TaskContext) -> Task:
    """Register ``sluice.generate`` on ``app``, bound to this worker's context."""

    @app.task(name=keys.TASK_NAME, acks_late=True, ignore_result=True, Request=ResumableRequest)
    def generate(payload: str) -> None:
        run_job(context, payload)

    return generate


def run_job(context: TaskContext, payload: str) -> None:
    """Run one job; raises ``Reject`` when its message must not simply be acked."""
    try:
        job = decode_queued(payload)
    except (ValueError, KeyError, TypeError) as exc:
        log.error("refusing a job that cannot be decoded: %s", exc)
        if (request_id := queued_request_id(payload)) is not None:
            _fail(context, request_id, f"the worker cannot read this job: {exc}")
        raise Reject(str(exc), requeue=False) from exc
    began = time.monotonic()
    try:
        start = _taken_start(context, job)
        outcome = _run(context, job, start)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        log.error("Redis failed while starting %s: %s", job.request.request_id, exc)
        raise Reject(str(exc), requeue=True) from exc
    except Exception as exc:
        log.exception("job %s failed", job.request.request_id)
        _fail(context, job.request.request_id, f"the worker failed: {exc}")
        raise
    log.info("%s: %s after %.3f s", job.request.request_id, outcome.value, time.monotonic() - began)
    if outcome in REQUEUED:
        log.info("handing %s back to the queue (%s)", job.request.request_id, outcome.value)
        requeue_first(context.client, job, outcome.value, (context.taken_key, start.delivery_tag))


def requeue_first(
    client: redis.Redis, job: QueuedRequest, reason: str, record: tuple[str, str]
) -> None:
    """Put ``job`` at the head of its queue and delete its taken ``record`` (key, delivery
    tag) in one transaction; ``Reject`` to the tail if Redis refuses.

    The record goes with the push, not with the ack that follows: an ack lost in a
    worker's shutdown would leave the record, and the job would be restored a second time
    when the worker is found gone, to fence out the resumption already running."""
    message = task_message(job)
    pipe = client.pipeline(transaction=True)
    pipe.rpush(message.key, message.body)
    pipe.lpush(message.wake, "1")
    pipe.hdel(*record)
    try:
        pipe.execute()
    except redis.RedisError as exc:
        raise Reject(f"{reason} ({exc})", requeue=True) from exc


def _run(context: TaskContext, job: QueuedRequest, start: Start) -> Outcome:
    request = job.request
    history = start.history
    if history.finished:
        return Outcome.FINISHED
    answer = _answer_without_engine(context.model, job, start.cancelled, history)
    if answer is not None:
        context.publisher.publish([Batch(request.request_id, start.attempt, 1, [answer])])
        return Outcome.FINISHED
    resume = Resume(history.token_ids, history.chars) if history.started else None
    log.info(
        "%s: attempt %d, %d prompt tokens%s",
        request.request_id,
        start.attempt,
        len(request.prompt_token_ids),
        f", resuming after {len(history.token_ids)} tokens" if resume else "",
    )
    run = Run(request, start.attempt, resume, job.origin)
    context.host.submit(run)  # a cancel heard since the flag was read still reaches it
    outcome = run.wait()
    assert outcome is not None  # waited without a timeout
    return outcome


def _answer_without_engine(
    model: str, job: QueuedRequest, cancelled: bool, history: History
) -> InferenceEvent | None:
    """The final event of a job that must not reach the engine, or None to run it."""
    request_id = job.request.request_id
    if job.request.model != model:  # routed to the wrong queue: no worker here can run it
        message = f"model {job.request.model!r} sent to a worker of {model!r}"
        return Error(request_id, message, "invalid_request")
    if cancelled:
        return Finish(request_id, FinishReason.ABORT, len(history.token_ids))
    if history.trimmed:
        return Error(request_id, "cannot resume: the start of the event stream was trimmed")
    deadline = job.deadlines.queue
    if not history.started and deadline is not None and time.time() > deadline:
        message = "the request waited in the queue past its deadline"
        return Error(request_id, message, "queue_timeout")
    return None


def _taken_start(context: TaskContext, job: QueuedRequest) -> Start:
    """The start the take script made as it took the job (``workers.broker.taken``);
    ``StartFailed`` if there is none or it cannot be read.

    Every message Sluice queues names its job (``shared.task_message``), so a
    start is missing only for a message from another producer, or one whose
    start was let go: either is an error, not a job to start another way.
    """
    taken = context.starts.pop(job.request.request_id)
    if taken is None:
        raise StartFailed("the job was not started as it was taken (its message names no job)")
    if isinstance(taken, Exception):
        raise StartFailed(f"cannot read the job's start: {taken}")
    try:
        return _start(job, taken)
    except (redis.ResponseError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise StartFailed(f"cannot read what earlier attempts wrote: {exc}") from exc


def _start(job: QueuedRequest, taken: TakenStart) -> Start:
    """One job's ``Start`` from its replies; raises the first reply that is an error."""
    for reply in (taken.attempt, taken.cancelled, taken.entries, taken.origin_alive):
        if isinstance(reply, Exception):
            raise reply
    history = History.read(job.request.request_id, taken.entries)
    cancelled = bool(taken.cancelled) or not taken.origin_alive
    return Start(int(taken.attempt), cancelled, history, taken.delivery_tag)


def _fail(context: TaskContext, request_id: str, message: str) -> None:
    """End the request with an Error under a fresh attempt, so no client waits forever."""
    try:
        pipe = context.client.pipeline(transaction=True)
        pipe.incr(keys.lease(request_id)).expire(keys.lease(request_id), keys.FINISHED_STREAM_TTL_S)
        attempt = int(pipe.execute()[0])
        context.publisher.publish([Batch(request_id, attempt, 1, [Error(request_id, message)])])
    except redis.RedisError as exc:
        log.error("could not report the failure of %s: %s", request_id, exc)
