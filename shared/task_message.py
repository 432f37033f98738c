"""A job as a Celery task message, written straight to kombu's Redis lists.

Senders that write with their own Redis client instead of ``send_task``
(the API queueing a burst in one pipeline, a worker putting a handed-back
job first in line) build the message here. Headers and body come from
Celery's task protocol 2 (``app.amqp.as_task_v2``), wrapped in the envelope
kombu's Redis transport reads, for the list kombu keeps that priority on.
``tests/distributed/test_job_queue.py`` compares it with ``send_task``'s.
"""

from __future__ import annotations

import base64
import json
import uuid
from bisect import bisect
from datetime import UTC, datetime
from functools import cache

from celery import Celery
from kombu.transport.redis import Channel

from shared import keys
from shared.wire import Job, encode_job

CELERY_PRIORITIES = range(10)  # kombu's Redis transport: 0 is served first


def task_message(job: Job) -> tuple[str, str]:
    """The Redis list ``job`` belongs on, and its message."""
    request, queue = job.request, keys.queue_name(job.request.model)
    expires = datetime.fromtimestamp(job.deadlines.queue, UTC) if job.deadlines.queue else None
    headers, properties, body, _ = _builder().amqp.as_task_v2(
        str(uuid.uuid4()), keys.TASK_NAME, args=[encode_job(job)], expires=expires
    )
    priority = min(max(request.priority, CELERY_PRIORITIES[0]), CELERY_PRIORITIES[-1])
    envelope = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            **properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return priority_list(queue, priority), json.dumps(envelope)


def priority_list(queue: str, priority: int) -> str:
    """The list kombu's Redis transport keeps ``queue``'s messages of ``priority`` on.

    Consumers pop from the right (``BRPOP``): ``LPUSH`` queues last, ``RPUSH`` first.
    """
    steps = Channel.priority_steps
    step = steps[bisect(steps, priority) - 1]
    return f"{queue}{Channel.sep}{step}" if step else queue


@cache
def _builder() -> Celery:
    """A Celery app that only builds messages; it never connects."""
    return Celery("sluice", set_as_current=False)
