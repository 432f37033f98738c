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
skipped and later pruned. Async jobs pass no bound. A request of a key with
rate limits passes its share (``api.rate_limits.KeyShare``): the same call
checks and takes it after the bound and before queueing, so the key's limits
cost no round trip of their own. The message is Celery's
own (``shared.task_message``); the script pushes the wake token beside it
and, when the caller passes it, its event reader's interrupt entry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import NamedTuple

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from api.backends.event_reader import INTERRUPT_TTL_S
from api.backends.placement import SHARED, Placement
from api.rate_limits import RATE_LIMIT_LUA, KeyShare, Verdict
from shared import keys
from shared.task_message import TaskMessage, task_message
from shared.wire import PreparedRequest, QueuedRequest

SEND_TIMEOUT_S = 10.0

SUBMIT_SCRIPT = (
    RATE_LIMIT_LUA
    + """
-- KEYS: the model's in-flight set, the queue's list, its wake list; then, if ARGV[9] is '1',
-- the key's rate-limit keys (rate_limit.lua); then the event reader's interrupt stream if
-- ARGV[7] is '1'; then the job's origin key when it has one.
-- ARGV: now, the bound (0: none), the job's in-flight score, its request id, its message,
-- the origin key's TTL, whether to interrupt the reader's read, the interrupt stream's TTL,
-- whether a key's share is taken, then rate_acquire's six arguments.
-- Returns {1} if queued, {0} if refused by the bound (the set already counted it); with a
-- share, {1 or -1 (refused by the key's limits), then rate_acquire's verdict}.
local rated = ARGV[9] == '1'
local next_key = rated and 7 or 4
if ARGV[7] == '1' then  -- whether queued or refused: the reader reads this job's stream next
  redis.call('XADD', KEYS[next_key], 'MAXLEN', 1, '*', 'w', '1')
  redis.call('EXPIRE', KEYS[next_key], ARGV[8])
  next_key = next_key + 1
end
local bound = tonumber(ARGV[2])
if bound > 0 and redis.call('ZCOUNT', KEYS[1], ARGV[1], '+inf') >= bound then
  return {0}
end
local verdict = nil
if rated then
  verdict = rate_acquire(KEYS[4], KEYS[5], KEYS[6], tonumber(ARGV[10]), tonumber(ARGV[11]),
                         tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14]),
                         tonumber(ARGV[15]))
  if verdict[1] == 0 then
    return {-1, verdict[2], verdict[3], verdict[4], verdict[5]}
  end
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('LPUSH', KEYS[2], ARGV[5])
redis.call('LPUSH', KEYS[3], '1')
if KEYS[next_key] then
  redis.call('SET', KEYS[next_key], '1', 'EX', ARGV[6])
end
if verdict then
  return {1, verdict[2], verdict[3], verdict[4], verdict[5]}
end
return {1}
"""
)


WITHDRAW_SCRIPT = """
-- KEYS: the job's list, its wake list, then the shared queue's list and wake list its
-- message moves to if handed back from a worker's own queue. ARGV: its message.
-- Removes a job no worker has taken yet, and a wake token with it. Returns 1 if removed.
for i = 1, 3, 2 do
  if redis.call('LREM', KEYS[i], 1, ARGV[1]) == 1 then
    redis.call('RPOP', KEYS[i + 1])
    return 1
  end
end
return 0
"""


class Submission(NamedTuple):
    """A submission's outcome: the message queued (None: refused), and with a key's share its
    verdict (refused by the key's limits when not ``allowed``).
    """

    message: TaskMessage | None
    verdict: Verdict | None


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
        share: KeyShare | None = None,
        placement: Placement = SHARED,
    ) -> Submission:
        """Join the model's in-flight set and queue ``job``, unless the set counts ``bound``
        or ``share``'s key has no room for it (its limits, checked and taken in the same call).

        The message queued (what ``withdraw`` removes), or None when refused,
        and the share's verdict; raises what Redis raised. Awaited in the caller's
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

        ``placement``: the queue, the model's shared one or a worker's own
        (``api.backends.placement``).
        """
        request = job.request
        message = task_message(job, placement.queue, placement.hand_back_at)
        script_keys = [keys.inflight(request.model), message.key, message.wake]
        if share is not None:
            script_keys += share.script_keys
        if interrupt is not None:
            script_keys.append(interrupt)
        if job.origin is not None:
            script_keys.append(keys.api_process(job.origin))
        args = [time.time(), bound or 0, inflight_score, request.request_id, message.body]
        args += [keys.API_PROCESS_TTL_S, int(interrupt is not None), INTERRUPT_TTL_S]
        args += [int(share is not None), *(share.script_args if share is not None else ())]
        async with asyncio.timeout(SEND_TIMEOUT_S):
            reply = await self._script(keys=script_keys, args=args)
        outcome, verdict = int(reply[0]), None
        if share is not None and len(reply) > 1:  # the key's limits were checked
            verdict = share.verdict([max(outcome, 0), *reply[1:]])
        return Submission(message if outcome == 1 else None, verdict)


def withdraw(pipe: Pipeline, message: TaskMessage) -> None:
    """Queue on ``pipe`` the removal of a job's message, if no worker has taken it yet.

    A request given up on before its first event (the client left, the queue
    deadline passed) would otherwise stay queued until a worker popped it only
    to drop it, counted meanwhile as queued work (``sluice_desired_workers``).
    Once taken, the message is not in the list and this removes nothing; the
    cancel flag stops it then.
    """
    script_keys = [message.key, message.wake, message.shared_key, message.shared_wake]
    pipe.eval(WITHDRAW_SCRIPT, len(script_keys), *script_keys, message.body)


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
