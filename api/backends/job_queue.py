"""Putting prepared requests on a model's Celery queue, shared by every sender.

The synchronous path (``DistributedBackend``) and async jobs
(``api.jobs.worker_queue``) both queue the same task the same way; what
differs is who owns the generation afterwards.

Why not ``Celery.send_task``: it is a blocking call, so every request paid a
hop to a thread and its own round trips (a routing lookup, then the push),
and a burst of 32 requests queued one after another behind the API's event
loop. ``JobQueue`` writes from the event loop through the async Redis
client instead, and group-commits: the requests that arrive while one write
is in flight go out together in the next, each as its in-flight entry plus
its message, in one pipeline.

The message is Celery's own: headers and body come from Celery's task
protocol 2 (``app.amqp.as_task_v2``), wrapped in the envelope kombu's Redis
transport reads, on the list kombu would push it to (one per priority step).
``tests/distributed/test_job_queue.py`` checks the envelope against kombu's.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import random
import uuid
from bisect import bisect
from datetime import UTC, datetime

from celery import Celery
from kombu.transport.redis import Channel
from redis.asyncio import Redis

from shared import keys
from shared.wire import Job, PreparedRequest, encode_job

SEND_TIMEOUT_S = 10.0
CELERY_PRIORITIES = range(10)  # kombu's Redis transport: 0 is served first


@dataclasses.dataclass(slots=True)
class _Pending:
    queue: str  # the Redis list
    message: str
    model: str
    request_id: str
    inflight_score: float
    done: asyncio.Future[None]


class JobQueue:
    """Queues jobs from the event loop, a burst per round trip; see the module docstring."""

    def __init__(self, client: Redis, app_name: str = "sluice-api") -> None:
        self._client = client
        self._celery = Celery(app_name, set_as_current=False)  # builds messages, never connects
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None

    async def put(self, job: Job, inflight_score: float) -> None:
        """Join the model's in-flight set and queue ``job``; raises what Redis raised."""
        request = job.request
        queue, message = self._message(job)
        done = asyncio.get_running_loop().create_future()
        self._pending.append(
            _Pending(queue, message, request.model, request.request_id, inflight_score, done)
        )
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="sluice-job-queue")
        await asyncio.wait_for(asyncio.shield(done), SEND_TIMEOUT_S)

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    for item in batch:
                        pipe.zadd(keys.inflight(item.model), {item.request_id: item.inflight_score})
                        pipe.lpush(item.queue, item.message)
                    await pipe.execute()
            except Exception as exc:  # every waiter hears it; the next burst tries again
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(exc)
            else:
                for item in batch:
                    if not item.done.done():
                        item.done.set_result(None)

    def _message(self, job: Job) -> tuple[str, str]:
        """The Redis list and the kombu envelope of ``job``'s task message."""
        request, queue = job.request, keys.queue_name(job.request.model)
        expires = datetime.fromtimestamp(job.deadlines.queue, UTC) if job.deadlines.queue else None
        task_id = str(uuid.uuid4())
        headers, properties, body, _ = self._celery.amqp.as_task_v2(
            task_id, keys.TASK_NAME, args=[encode_job(job)], expires=expires, ignore_result=True
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
    """The list kombu's Redis transport keeps ``queue``'s messages of ``priority`` on."""
    steps = Channel.priority_steps
    step = steps[bisect(steps, priority) - 1]
    return f"{queue}{Channel.sep}{step}" if step else queue


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
