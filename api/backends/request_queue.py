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
from api.rate_limits import RATE_LIMIT, KeyShare, Verdict
from shared import keys, lua
from shared.task_message import TaskMessage, task_message
from shared.wire import PreparedRequest, QueuedRequest

SEND_TIMEOUT_S = 10.0

SUBMIT = lua.load("api.backends", "submit", RATE_LIMIT)
WITHDRAW = lua.load("api.backends", "withdraw")


class Submission(NamedTuple):
    """A submission's outcome: the message queued (None: refused), and with a key's share its
    verdict (refused by the key's limits when not ``allowed``).
    """

    message: TaskMessage | None
    verdict: Verdict | None


class RequestQueue:
    """Queues jobs from the event loop, each at once; see the module docstring."""

    def __init__(self, client: Redis) -> None:
        self._script = SUBMIT.bind(client)

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


async def withdraw(pipe: Pipeline, message: TaskMessage) -> None:
    """Queue on ``pipe`` the removal of a job's message, if no worker has taken it yet.

    A request given up on before its first event (the client left, the queue
    deadline passed) would otherwise stay queued until a worker popped it only
    to drop it, counted meanwhile as queued work (``sluice_desired_workers``).
    Once taken, the message is not in the list and this removes nothing; the
    cancel flag stops it then. Awaiting it sends nothing: ``pipe`` loads the script
    before it executes if Redis lacks it (redis-py's pipeline scripts).
    """
    script_keys = [message.key, message.wake, message.shared_key, message.shared_wake]
    await WITHDRAW.bind(pipe)(keys=script_keys, args=[message.body])


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
