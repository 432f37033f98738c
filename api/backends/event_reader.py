"""One reader of request event streams per API process, fanned out to per-request queues.

A request in flight registers its stream with ``open``; one background task
runs ``XREAD BLOCK`` over every registered stream and puts each decoded event
on that request's ``asyncio.Queue``: one blocked command serves them all.
The ``XREAD`` also reads this process's interrupt stream, so that a new
stream need not wait for the block to time out: registering appends to it
(once per block), or hands the entry to the caller's own next write
(``take_interrupt``, which the request queue's submit script appends).
Every stream is read from id ``0`` and its last id kept, so whatever a
worker wrote before the first read, or while a read was rebuilt, is
delivered in order and once.

Fencing is repeated here cheaply: events of an attempt older than the newest
one seen are dropped, and so are an event whose sequence number this attempt
already delivered (its write was repeated) and a second ``Accepted`` or ``Ready``.

If Redis stays unreachable for longer than ``outage_grace_s``, or comes back
as a different server (its ``run_id`` changed: the streams are lost), every
open request ends with an ``Error(kind="unavailable")``; a short blip with
the same server loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from shared import keys
from shared.event_codec import Entry, decode_entry
from shared.events import Accepted, Error, Finish, InferenceEvent, Ready

log = logging.getLogger(__name__)

INTERRUPT_TTL_S = 600  # a dead process's interrupt stream disappears on its own
STOP_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Subscription:
    """One request's place in the reader: its queue, read position and fence."""

    request_id: str
    events: asyncio.Queue[InferenceEvent] = field(default_factory=asyncio.Queue)
    last_id: str = "0"
    attempt: int = 0  # the newest attempt seen
    seq: int = 0  # the newest sequence number of that attempt
    once_seen: set[type] = field(default_factory=set)  # of the events a request gets once
    ended: bool = False  # a Finish or Error was delivered

    def accept(self, entry: Entry) -> bool:
        """False for a stale attempt's event, a repeated event, or a second ``Accepted``
        or ``Ready`` (a later attempt's)."""
        attempt, seq, event = entry
        if attempt < self.attempt or (attempt == self.attempt and seq <= self.seq):
            return False
        self.attempt, self.seq = attempt, seq
        if isinstance(event, Accepted | Ready):
            if type(event) in self.once_seen:
                return False
            self.once_seen.add(type(event))
        return True

    def deliver(self, event: InferenceEvent) -> None:
        if self.ended:
            return
        self.ended = isinstance(event, Finish | Error)
        self.events.put_nowait(event)


class EventReader:
    """The per-process multiplexed stream reader; see the module docstring."""

    def __init__(
        self,
        redis_url: str,
        *,
        block_ms: int = 5000,
        count: int = 256,
        outage_grace_s: float = 2.0,
        max_backoff_s: float = 2.0,
    ) -> None:
        self._client = Redis.from_url(
            redis_url,
            decode_responses=True,
            socket_timeout=block_ms / 1000 + 5,
            socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 0),  # a dropped connection must reach the loop, not be hidden
        )
        self._block_ms = block_ms
        self._count = count
        self._outage_grace_s = outage_grace_s
        self._max_backoff_s = max_backoff_s
        self._interrupt_key = keys.reader_interrupt(uuid.uuid4().hex)
        self._interrupt_last_id = "0"
        self._subscriptions: dict[str, Subscription] = {}  # by stream key
        self._blocked = False  # an XREAD is in flight
        self._interrupted = False  # ... and an interrupt entry was already sent for it
        self._background: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self._run_id: str | None = None
        self._down_since: float | None = None
        self._stopping = False
        self.connected = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sluice-event-reader")

    async def stop(self) -> None:
        """Stop reading; every open request ends with an ``Error``.

        The loop is asked to end and woken rather than cancelled: cancelling
        a blocked ``XREAD`` can leave redis-py waiting on the connection.
        Only a loop that does not end soon (Redis gone) is cut off.
        """
        self._stopping = True
        if self._task is not None:
            await self._send_interrupt()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STOP_TIMEOUT_S)
            except TimeoutError:
                self._task.cancel()
                await self._client.connection_pool.disconnect()
        self._fail_all("the server is shutting down", "overloaded")
        for task in list(self._background):
            task.cancel()
        await self._client.aclose()

    def open(self, request_id: str, *, interrupt: bool = True) -> Subscription:
        """Start delivering ``request_id``'s events, from the beginning of its stream.

        With ``interrupt=False`` the caller must call ``take_interrupt`` at once and
        send the entry it names, if any, itself.
        """
        subscription = Subscription(request_id)
        self._subscriptions[keys.event_stream(request_id)] = subscription
        if interrupt:
            self._interrupt()
        return subscription

    def take_interrupt(self) -> str | None:
        """The interrupt stream a caller must append to, or None if none is due.

        The entry is what ``_send_interrupt`` writes: ``XADD <key> MAXLEN 1 * w 1``,
        then ``EXPIRE <key> INTERRUPT_TTL_S``.

        None when no read is blocked (the next one includes every open
        stream) or an interrupt is already on its way. An interrupt that is taken and
        then lost (its write failed) delays new streams until the blocked
        read times out (``block_ms``).
        """
        if not self._blocked or self._interrupted:
            return None
        self._interrupted = True
        return self._interrupt_key

    def close(self, request_id: str) -> None:
        self._subscriptions.pop(keys.event_stream(request_id), None)

    @property
    def open_count(self) -> int:
        return len(self._subscriptions)

    # --- waking a blocked read ------------------------------------------------

    def _interrupt(self) -> None:
        """Return the blocked ``XREAD`` so the next one includes the new stream."""
        if not self._blocked or self._interrupted:
            return  # the next XREAD is built from the current registrations anyway
        self._interrupted = True
        task = asyncio.create_task(self._send_interrupt())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_interrupt(self) -> None:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xadd(self._interrupt_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.expire(self._interrupt_key, INTERRUPT_TTL_S)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # the read loop notices the outage itself
            log.debug("waking the event reader failed: %s", exc)

    # --- the loop ---------------------------------------------------------------

    async def _run(self) -> None:
        """Read until stopped; an outage, or a failure of any kind, is retried with backoff.

        The outage ends at the first read that succeeds, not at the
        reconnection: a server that accepts connections but fails every
        ``XREAD`` must still back off and, past the grace, fail the requests.
        """
        backoff = 0.05
        while not self._stopping:
            try:
                await self._connect()
                await self._read_once()
                self._recovered()
                backoff = 0.05
                while not self._stopping:
                    await self._read_once()
            except Exception as exc:  # not only Redis: a dead loop would hang every request
                self.connected = False
                if self._stopping:
                    return
                if not isinstance(exc, RedisError | OSError):
                    log.exception("reading the event streams failed")
                self._note_outage(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)

    async def _connect(self) -> None:
        """Check that Redis answers and is the server the open streams live on."""
        run_id = (await self._client.info("server"))["run_id"]
        if self._run_id is not None and run_id != self._run_id:
            log.warning("Redis restarted (run_id changed); failing the requests in flight")
            self._fail_all("Redis restarted and lost this request's events; retry it")
        self._run_id, self.connected = run_id, True

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.info("reading again after %.1fs", time.monotonic() - self._down_since)
        self._down_since = None

    def _note_outage(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._down_since is None:
            log.warning("lost the connection to Redis: %s; reconnecting", exc)
            self._down_since = now
        if now - self._down_since >= self._outage_grace_s and self._subscriptions:
            self._fail_all(f"lost the connection to Redis ({exc}); retry the request")

    async def _read_once(self) -> None:
        streams = {self._interrupt_key: self._interrupt_last_id}
        streams.update({key: sub.last_id for key, sub in self._subscriptions.items()})
        self._blocked, self._interrupted = True, False
        try:
            reply = await self._client.xread(streams, count=self._count, block=self._block_ms)
        finally:
            self._blocked = False
        for key, entries in reply or []:  # RESP2: [[stream, [(id, fields), ...]], ...]
            if key == self._interrupt_key:
                self._interrupt_last_id = entries[-1][0]
            else:
                self._dispatch(key, entries)

    def _dispatch(self, key: str, entries: list[tuple[str, dict[str, str]]]) -> None:
        subscription = self._subscriptions.get(key)
        if subscription is None:
            return  # the request ended while the read was in flight
        for entry_id, fields in entries:
            subscription.last_id = entry_id
            try:
                entry = decode_entry(subscription.request_id, fields)
            except (KeyError, ValueError, TypeError, IndexError) as exc:
                log.error("skipping a malformed event in %s (%s): %s", key, entry_id, exc)
                continue
            if subscription.accept(entry):
                subscription.deliver(entry.event)
            if subscription.ended:
                self._subscriptions.pop(key, None)
                return

    def _fail_all(self, message: str, kind: str = "unavailable") -> None:
        for subscription in self._subscriptions.values():
            subscription.deliver(Error(subscription.request_id, message, kind))
        self._subscriptions.clear()
