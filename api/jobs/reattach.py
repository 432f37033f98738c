"""Re-attaching to a request that already runs on the workers (distributed mode).

A worker writes every event of a request to its Redis Stream whatever
happens to the API that submitted it, so an API process that adopts a job
reads that stream from the start instead of submitting the request again.
``RequestStreams.events`` yields the events with the same contract as a
backend's ``infer``: it ends after a ``Finish`` or ``Error``, and closing it
earlier cancels the request on the worker (the cancel flag and channel of
``shared.keys``, as the distributed backend does). The fencing of stale
attempts is the live reader's own (``Subscription.accept``), so a replay
delivers exactly the events the first reader delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.backends.event_reader import Subscription
from shared import keys
from shared.event_codec import decode_event
from shared.events import Error, Finish, InferenceEvent

log = logging.getLogger(__name__)

BLOCK_MS = 5000
CANCEL_TIMEOUT_S = 5.0


class RequestStreams:
    """Reads and cancels requests by id, from any API process.

    Once ``stopping`` is set (the API shuts down) a closed reader cancels
    nothing: the request goes on for the process that adopts its job next.
    """

    def __init__(self, redis_url: str) -> None:
        self._redis = Redis.from_url(
            redis_url,
            decode_responses=True,
            socket_timeout=BLOCK_MS / 1000 + 5,
            socket_connect_timeout=2,
        )
        self.stopping = False

    async def events(self, request_id: str, deadline: float) -> AsyncIterator[InferenceEvent]:
        """The request's events from its first; a ``total_timeout`` error past ``deadline``."""
        key, last, fence = keys.event_stream(request_id), "0", Subscription(request_id)
        finished = False
        try:
            while True:
                remaining_ms = int((deadline - time.time()) * 1000)
                if remaining_ms <= 0:
                    message = "The generation did not finish before its deadline."
                    yield Error(request_id, message, "total_timeout")
                    return
                reply = await self._redis.xread(
                    {key: last}, count=256, block=min(remaining_ms, BLOCK_MS)
                )
                for entry_id, fields in reply[0][1] if reply else []:
                    last = entry_id
                    try:
                        attempt, event = decode_event(request_id, fields)
                    except (KeyError, ValueError, TypeError, IndexError) as exc:
                        log.error("skipping a malformed event of %s: %s", request_id, exc)
                        continue
                    if not fence.accept(attempt, event):
                        continue
                    finished = isinstance(event, Finish | Error)
                    yield event
                    if finished:
                        return
        finally:
            if not finished and not self.stopping:
                with anyio.CancelScope(shield=True):
                    await self.cancel(request_id)

    async def cancel(self, request_id: str) -> None:
        """Ask the workers to stop ``request_id``; one that has not started it drops it."""
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.set(keys.cancel_flag(request_id), "1", ex=keys.FINISHED_STREAM_TTL_S)
                    pipe.publish(keys.CANCEL_CHANNEL, request_id)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("cancelling %s failed: %s", request_id, exc)

    async def close(self) -> None:
        await self._redis.aclose()


__all__ = ["RequestStreams"]
