"""Putting prepared requests on a model's Celery queue, for the request channel.

Not ``Celery.send_task``, a blocking call: every request would pay a hop to
a thread and round trips of its own, and a burst would queue behind the
API's event loop. ``RequestQueue`` writes through the async Redis client, in
the step of the request's own task, so the command leaves before the loop
turns.

The write is one script call, which also keeps the model's bound on
outstanding work (``--max-inflight``): a request joins the model's in-flight
set and its queue only while the set counts fewer live entries than the
bound, so API processes sharing the set cannot overshoot it together. The
set is scored with the request's total deadline, after which an entry stops
counting (``ZCOUNT now +inf``), so what a crashed process left behind is
skipped and later pruned. Async jobs pass no bound. The message is Celery's
own (``shared.task_message``); the script pushes the wake token beside it
and, when the caller passes it, its event reader's interrupt entry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from api.backends.event_reader import INTERRUPT_TTL_S
from shared import keys
from shared.task_message import TaskMessage, task_message
from shared.wire import PreparedRequest, QueuedRequest

SEND_TIMEOUT_S = 10.0

SUBMIT_SCRIPT = """
-- KEYS: the model's in-flight set, the queue's list, its wake list, then the event reader's
-- interrupt stream if ARGV[7] is '1', then the job's origin key when it has one.
-- ARGV: now, the bound (0: none), the job's in-flight score, its request id, its message,
-- the origin key's TTL, whether to interrupt the reader's read, the interrupt stream's TTL.
-- Returns 1 if queued, 0 if refused: the set already counted the bound.
local origin = 4
if ARGV[7] == '1' then  -- whether queued or refused: the reader reads this job's stream next
  redis.call('XADD', KEYS[4], 'MAXLEN', 1, '*', 'w', '1')
  redis.call('EXPIRE', KEYS[4], ARGV[8])
  origin = 5
end
local bound = tonumber(ARGV[2])
if bound > 0 and redis.call('ZCOUNT', KEYS[1], ARGV[1], '+inf') >= bound then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('LPUSH', KEYS[2], ARGV[5])
redis.call('LPUSH', KEYS[3], '1')
if KEYS[origin] then
  redis.call('SET', KEYS[origin], '1', 'EX', ARGV[6])
end
return 1
"""


WITHDRAW_SCRIPT = """
-- KEYS: the job's list, its wake list. ARGV: its message.
-- Removes a job no worker has taken yet, and a wake token with it. Returns 1 if removed.
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then
  return 0
end
redis.call('RPOP', KEYS[2])
return 1
"""


class RequestQueue:
    """Queues jobs from the event loop, each at once; see the module docstring."""

    def __init__(self, client: Redis) -> None:
        self._script = client.register_script(SUBMIT_SCRIPT)

    async def put(
        self,
        job: QueuedRequest,
        inflight_score: float,
        bound: int | None = None,
        interrupt: str | None = None,
    ) -> TaskMessage | None:
        """Join the model's in-flight set and queue ``job``, unless the set counts ``bound``.

        The message queued (what ``withdraw`` removes), or None when refused;
        raises what Redis raised. Awaited in the caller's
        own task (``asyncio.timeout``, not ``wait_for``, which would start a
        task of its own and send on the next turn). A caller cancelled while
        waiting for the reply may still have queued the job; its cleanup
        cancels the request, which a worker then drops without running it.

        The job's origin key is set with it: a worker drops a job whose origin
        key is missing, and after Redis lost its data (a restart) the key is
        missing until the next renewal, up to a second away.

        ``interrupt``: the event reader's interrupt stream
        (``EventReader.take_interrupt``), appended to in the same call, whether
        the job is queued or refused.
        """
        request = job.request
        message = task_message(job)
        script_keys = [keys.inflight(request.model), message.key, message.wake]
        if interrupt is not None:
            script_keys.append(interrupt)
        if job.origin is not None:
            script_keys.append(keys.api_process(job.origin))
        args = [time.time(), bound or 0, inflight_score, request.request_id, message.body]
        args += [keys.API_PROCESS_TTL_S, int(interrupt is not None), INTERRUPT_TTL_S]
        async with asyncio.timeout(SEND_TIMEOUT_S):
            queued = await self._script(keys=script_keys, args=args)
        return message if queued else None


def withdraw(pipe: Pipeline, message: TaskMessage) -> None:
    """Queue on ``pipe`` the removal of a job's message, if no worker has taken it yet.

    A request given up on before its first event (the client left, the queue
    deadline passed) would otherwise stay queued until a worker popped it only
    to drop it, counted meanwhile as queued work (``sluice_desired_workers``).
    Once taken, the message is not in the list and this removes nothing; the
    cancel flag stops it then.
    """
    pipe.eval(WITHDRAW_SCRIPT, 2, message.key, message.wake, message.body)


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
