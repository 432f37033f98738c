"""A job as a Celery task message, written straight to kombu's Redis lists.

Senders that write with their own Redis client instead of ``send_task``
(the API queueing each request from its event loop, a worker putting a
handed-back job first in line) build the message here, and push a wake
token beside it. Headers and body come from
Celery's task protocol 2 (``app.amqp.as_task_v2``), wrapped in the envelope
kombu's Redis transport reads, for the list kombu keeps that priority on.
``tests/distributed/test_request_queue.py`` compares it with ``send_task``'s.
"""

from __future__ import annotations

import base64
import json
import uuid
from bisect import bisect
from datetime import UTC, datetime
from functools import cache
from typing import NamedTuple

from celery import Celery
from kombu.transport.redis import Channel

from shared import keys
from shared.wire import QueuedRequest, encode_queued

CELERY_PRIORITIES = range(10)  # kombu's Redis transport: 0 is served first


REQUEST_HEADER = "sluice_request"
"""A header naming the job, for the script that takes it to start it (``workers.broker.taken``),
and, on a worker's own queue, when it goes back to the shared queue (``workers/broker/scripts``)."""


def request_header(job: QueuedRequest, hand_back_at: float | None = None) -> list[str | float]:
    """``REQUEST_HEADER``'s value: the request id, the origin (empty when none) and, for a job
    on a worker's own queue, the Unix time it is handed back to the shared queue if still there.
    """
    header: list[str | float] = [job.request.request_id, job.origin or ""]
    return header if hand_back_at is None else [*header, hand_back_at]


class TaskMessage(NamedTuple):
    """A job's message, the list it goes on, and the list of its wake token.

    Whoever pushes ``body`` onto ``key`` pushes a token onto ``wake`` in the
    same transaction: workers block on the tokens (``keys.queue_wake``). A
    message on a worker's own queue may move to the shared queue's list and
    wake list (``shared_key``, ``shared_wake``); on the shared queue they
    are ``key`` and ``wake``.
    """

    key: str
    body: str
    wake: str
    shared_key: str
    shared_wake: str


def task_message(
    job: QueuedRequest, queue: str | None = None, hand_back_at: float | None = None
) -> TaskMessage:
    """The message of ``job``, for the list of its priority on ``queue``.

    ``queue``: the model's shared queue unless a worker's own
    (``keys.own_queue``), which then needs ``hand_back_at``.
    """
    request = job.request
    shared = keys.queue_name(request.model)
    queue = queue or shared
    expires = datetime.fromtimestamp(job.deadlines.queue, UTC) if job.deadlines.queue else None
    headers, properties, body, _ = _builder().amqp.as_task_v2(
        str(uuid.uuid4()),
        keys.TASK_NAME,
        args=[encode_queued(job)],
        expires=expires,
        argsrepr=f"<job {request.request_id}>",  # what monitors show; not a repr of the prompt
        kwargsrepr="{}",
    )
    priority = min(max(request.priority, CELERY_PRIORITIES[0]), CELERY_PRIORITIES[-1])
    envelope = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {**headers, REQUEST_HEADER: request_header(job, hand_back_at)},
        "properties": {
            **properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return TaskMessage(
        priority_list(queue, priority),
        json.dumps(envelope),
        keys.queue_wake(queue),
        priority_list(shared, priority),
        keys.queue_wake(shared),
    )


def priority_list(queue: str, priority: int) -> str:
    """The list kombu's Redis transport keeps ``queue``'s messages of ``priority`` on.

    Workers pop from the right (``workers.broker.transport``): ``LPUSH`` queues last,
    ``RPUSH`` first.
    """
    steps = Channel.priority_steps
    step = steps[bisect(steps, priority) - 1]
    return f"{queue}{Channel.sep}{step}" if step else queue


def queue_lists(queue: str) -> list[str]:
    """The Redis lists of ``queue``: kombu keeps one per priority step."""
    return [priority_list(queue, step) for step in Channel.priority_steps]


def list_suffixes() -> list[str]:
    """What follows a queue's name in the names of its lists, one per priority step."""
    return [priority_list("", step) for step in Channel.priority_steps]


@cache
def _builder() -> Celery:
    """A Celery app that only builds messages; it never connects."""
    return Celery("sluice", set_as_current=False)
