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
message, in one script call, without waiting for the reply to the write before.
A request is on its way 0.8 ms (p50) after it is submitted, at 32 concurrent
streams on two shared cores.

The write is one script, which also keeps the model's bound on outstanding
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

from api.turn_batch import TurnBatcher
from shared import keys
from shared.task_message import task_message
from shared.wire import Job, PreparedRequest

SEND_TIMEOUT_S = 10.0

SUBMIT_SCRIPT = """
-- KEYS: per job, its model's in-flight set, then its queue.
-- ARGV: now, then per job: the bound (0: none), its in-flight score, request id, message.
-- Returns the 1-based indexes of the jobs refused: the set already counted the bound.
local now = tonumber(ARGV[1])
local refused = {}
for i = 1, #KEYS / 2 do
  local inflight, queue, arg = KEYS[2 * i - 1], KEYS[2 * i], 4 * i - 2
  local bound = tonumber(ARGV[arg])
  if bound > 0 and redis.call('ZCOUNT', inflight, now, '+inf') >= bound then
    refused[#refused + 1] = i
  else
    redis.call('ZADD', inflight, ARGV[arg + 1], ARGV[arg + 2])
    redis.call('LPUSH', queue, ARGV[arg + 3])
  end
end
return refused
"""


@dataclasses.dataclass(slots=True)
class _Pending:
    queue: str  # the Redis list
    message: str
    model: str
    request_id: str
    inflight_score: float
    bound: int  # 0: none


class JobQueue:
    """Queues jobs from the event loop, a burst per round trip; see the module docstring."""

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._script = client.register_script(SUBMIT_SCRIPT)
        self._batcher: TurnBatcher[_Pending, bool] = TurnBatcher(self._write)

    async def put(self, job: Job, inflight_score: float, bound: int | None = None) -> bool:
        """Join the model's in-flight set and queue ``job``, unless the set counts ``bound``.

        False when refused; raises what Redis raised.
        """
        request = job.request
        queue, message = task_message(job)
        pending = _Pending(
            queue, message, request.model, request.request_id, inflight_score, bound or 0
        )
        return await asyncio.wait_for(asyncio.shield(self._batcher.put(pending)), SEND_TIMEOUT_S)

    async def _write(self, batch: list[_Pending]) -> list[bool]:
        script_keys: list[str] = []
        args: list[str | float | int] = [time.time()]
        for item in batch:
            script_keys += [keys.inflight(item.model), item.queue]
            args += [item.bound, item.inflight_score, item.request_id, item.message]
        refused = {int(index) - 1 for index in await self._script(keys=script_keys, args=args)}
        return [index not in refused for index in range(len(batch))]


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
