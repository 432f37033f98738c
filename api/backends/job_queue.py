"""Putting prepared requests on a model's Celery queue, shared by every sender.

The synchronous path (``DistributedBackend``) and async jobs
(``api.jobs.worker_queue``) both queue the same task the same way; what
differs is who owns the generation afterwards.

Why not ``Celery.send_task``: it is a blocking call, so every request paid a
hop to a thread and its own round trips (a routing lookup, then the push),
and a burst of 32 requests queued one after another behind the API's event
loop. ``JobQueue`` writes from the event loop through the async Redis
client instead, in the step of the request's own task: the command leaves
before the loop turns. The requests of one turn used to be batched into one
write, sent on the next turn; with 32 streams in flight the rest of a busy
turn kept each job 9.6 ms (p50) from Redis, while a write of its own costs
Redis and the loop a few microseconds more.

The write is one script call, which also keeps the model's bound on outstanding
work (``--max-inflight``): each job joins the model's in-flight set and its
queue only while the set counts fewer live entries than the bound, so API
processes that share the set cannot overshoot it together. The set is scored
with the time after which an entry stops counting (the request's total
deadline): ``ZCOUNT now +inf`` skips what a crashed process left behind,
and the fleet watcher prunes it. Async jobs pass no bound: they are refused,
if at all, before they are accepted.

The message is Celery's own, built by ``shared.task_message``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

from redis.asyncio import Redis

from shared import keys
from shared.task_message import task_message
from shared.wire import Job, PreparedRequest

SEND_TIMEOUT_S = 10.0

SUBMIT_SCRIPT = """
-- KEYS: the model's in-flight set, the queue. ARGV: now, the bound (0: none),
-- the job's in-flight score, its request id, its message.
-- Returns 1 if queued, 0 if refused: the set already counted the bound.
local bound = tonumber(ARGV[2])
if bound > 0 and redis.call('ZCOUNT', KEYS[1], ARGV[1], '+inf') >= bound then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('LPUSH', KEYS[2], ARGV[5])
return 1
"""


class JobQueue:
    """Queues jobs from the event loop, each at once; see the module docstring."""

    def __init__(self, client: Redis) -> None:
        self._script = client.register_script(SUBMIT_SCRIPT)

    async def put(self, job: Job, inflight_score: float, bound: int | None = None) -> bool:
        """Join the model's in-flight set and queue ``job``, unless the set counts ``bound``.

        False when refused; raises what Redis raised. Awaited in the caller's
        own task (``asyncio.timeout``, not ``wait_for``, which would start a
        task of its own and send on the next turn). A caller cancelled while
        waiting for the reply may still have queued the job; its cleanup
        cancels the request, which a worker then drops without running it.
        """
        request = job.request
        queue, message = task_message(job)
        script_keys = [keys.inflight(request.model), queue]
        args = [time.time(), bound or 0, inflight_score, request.request_id, message]
        async with asyncio.timeout(SEND_TIMEOUT_S):
            return bool(await self._script(keys=script_keys, args=args))


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
