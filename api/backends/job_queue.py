"""Putting prepared requests on a model's Celery queue, shared by every sender.

The synchronous path (``DistributedBackend``) and async jobs
(``api.jobs.worker_queue``) both queue the same task the same way; what
differs is who owns the generation afterwards.

Why not ``Celery.send_task``: it is a blocking call, so every request paid a
hop to a thread and its own round trips (a routing lookup, then the push),
and a burst of 32 requests queued one after another behind the API's event
loop. ``JobQueue`` writes from the event loop through the async Redis
client instead, and batches (``api.turn_batch``): the requests queued in one
turn of the event loop go out together, each as its in-flight entry plus its
message, in one pipeline, without waiting for the reply to the write before.
A request is on its way 0.8 ms (p50) after it is submitted, at 32 concurrent
streams on two shared cores.

The message is Celery's own, built by ``shared.task_message``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from redis.asyncio import Redis

from api.turn_batch import TurnBatcher
from shared import keys
from shared.task_message import task_message
from shared.wire import Job, PreparedRequest

SEND_TIMEOUT_S = 10.0


@dataclasses.dataclass(slots=True)
class _Pending:
    queue: str  # the Redis list
    message: str
    model: str
    request_id: str
    inflight_score: float


class JobQueue:
    """Queues jobs from the event loop, a burst per round trip; see the module docstring."""

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._batcher: TurnBatcher[_Pending, None] = TurnBatcher(self._write)

    async def put(self, job: Job, inflight_score: float) -> None:
        """Join the model's in-flight set and queue ``job``; raises what Redis raised."""
        request = job.request
        queue, message = task_message(job)
        pending = _Pending(queue, message, request.model, request.request_id, inflight_score)
        await asyncio.wait_for(asyncio.shield(self._batcher.put(pending)), SEND_TIMEOUT_S)

    async def _write(self, batch: list[_Pending]) -> list[None]:
        async with self._client.pipeline(transaction=False) as pipe:
            for item in batch:
                pipe.zadd(keys.inflight(item.model), {item.request_id: item.inflight_score})
                pipe.lpush(item.queue, item.message)
            await pipe.execute()
        return [None] * len(batch)


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
