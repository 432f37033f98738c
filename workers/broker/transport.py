"""kombu's Redis transport: waking on tokens, taking and starting jobs in one step, per worker.

A worker blocks on the queues' wake lists (``keys.queue_wake``; every sender
pushes one token beside each job), its own queue's (``keys.own_queue``)
among them, which it takes from first at each priority. Sent right behind that read, on the same
connection, goes the take script (``scripts/take.lua``), which Redis runs
the moment the read returns: it pops up to the worker's prefetch credit (in
kombu's priority order), records each message in the worker's own taken
records (``keys.taken``), starts each job its message names (next attempt,
cancel flag, stream so far, whether its API process lives: left in
``workers.broker.taken``) and leaves each wake list as long as the jobs
still queued. One round trip wakes, takes and starts, and a job is always
in its queue or in one worker's records (kombu's own ``BRPOP`` and record
are two steps, and a worker killed between them loses the job). A message
queued without a token is taken when the read times out (1 s).

Taken records go back to the head of their queues when their worker dies
(``workers.heartbeat``), leaves, or closes its channel, so kombu's
visibility sweep does nothing. No read is sent while the engine's intake is
closed (``workers.broker.intake``); one already waiting is still read.

An ack frees its credit at once and queues the removal of its record; the
event loop writes every removal due in one write before it polls again, and
the first ack wakes it (Celery acks from the task's thread). A lost removal
only means a finished job is restored once more, which its stream's
``Finish`` turns into an immediate ack.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from functools import cached_property
from time import monotonic
from typing import Any

import redis
from kombu.asynchronous import Hub
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from shared import keys
from shared.task_message import REQUEST_HEADER
from workers.broker.scripts import RESTORE, TAKE
from workers.broker.taken import TakenStart

log = logging.getLogger(__name__)

LINK_OPTION = "sluice_link"
"""The transport option that hands a ``workers.broker.BrokerLink`` to the transport."""
BINDING_PREFIXES = (
    kombu_redis.Channel.keyprefix_queue % "",
    kombu_redis.Channel.keyprefix_binding_permanent % "",
)
"""The prefixes of the two keys kombu keeps per consumed queue: a worker's own queue's are
deleted when the worker leaves or is found dead (``workers.heartbeat``)."""
UNBOUNDED_BURST = 64  # the most one read takes for a consumer without a prefetch limit
START_ARGS = (  # the take script's arguments to start the jobs it takes
    keys.lease(""),
    keys.cancel_flag(""),
    keys.event_stream(""),
    keys.api_process(""),
    keys.FINISHED_STREAM_TTL_S,
    REQUEST_HEADER,
)


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS over this worker's taken records, acks removed in bursts.

    The take script writes the records, so ``append`` only counts the
    delivery; a closed intake leaves no credit (see the module docstring).
    A record is keyed by its message's delivery tag, which a message keeps
    when it goes back to its queue: should this worker take it again while
    an earlier delivery of it is still running (fenced out, about to ack),
    the record stays until the last delivery ends (or until a delivery
    hands the job back: ``workers.task.requeue_first`` deletes the record
    as it queues the job again). A requeue that finds Redis unreachable is
    kept and sent again, like an ack, until it lands.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []  # acked tags whose records are still in Redis
        self._requeued: list[str] = []  # rejected tags still to go back to their queues
        self._holding: Counter[str] = Counter()  # deliveries not yet ended, by tag
        self._acks_lock = threading.Lock()

    @cached_property
    def _link(self) -> Any:
        return self.channel.link

    def can_consume(self) -> bool:
        """A closed intake stops new reads; one in flight is still read.

        Its jobs are taken already (the script ran as its wait ended), and
        kombu leaves a reply it may not consume unread: they would sit in the
        socket, recorded as taken, while nothing ran them.
        """
        reading = bool(self.channel._in_poll)
        return (self._link.intake.open or reading) and super().can_consume()

    def can_consume_max_estimate(self) -> int:
        if not self._link.intake.open:
            return 0
        estimate = super().can_consume_max_estimate()
        return UNBOUNDED_BURST if estimate is None else estimate

    def append(self, message: Any, delivery_tag: str) -> None:
        VirtualQoS.append(self, message, delivery_tag)  # the take script wrote its record
        with self._acks_lock:
            self._holding[delivery_tag] += 1

    def ack(self, delivery_tag: str) -> None:
        VirtualQoS.ack(self, delivery_tag)  # the credit is free now
        self._end(delivery_tag, self._acked)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """Requeued: back to the tail of its queue (kombu's ``reject``); else as an ack."""
        VirtualQoS.ack(self, delivery_tag)
        self._end(delivery_tag, self._requeued if requeue else self._acked)

    def _end(self, delivery_tag: str, pending: list[str]) -> None:
        """Queue what ends this delivery's record, written by the loop before it polls again."""
        with self._acks_lock:
            left = self._holding[delivery_tag] - 1
            if left > 0:  # an earlier delivery of the same message: the record is the later's
                self._holding[delivery_tag] = left
                return
            self._holding.pop(delivery_tag, None)
            first = not self._acked and not self._requeued  # no flush is due yet
            pending.append(delivery_tag)
        connection = self.channel.connection  # None once the channel closed (Redis went away)
        loop = None if connection is None else connection.event_loop
        if loop is None:
            self.flush_acks()
        elif first:
            loop.call_soon(self.flush_acks)  # from a task thread, this wakes the loop

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        """Put one taken message back: at its queue's head, or its tail if ``leftmost``."""
        with self.channel.conn_or_acquire(client) as client:
            RESTORE.bind(client)(
                keys=[self._link.taken_key], args=["tail" if leftmost else "head", tag]
            )

    def restore_unacked(self, client: Any = None) -> None:
        """Every message this worker still holds goes back to the head of its queue."""
        self.flush_acks()
        with self.channel.conn_or_acquire(client) as client:
            RESTORE.bind(client)(keys=[self._link.taken_key], args=["head"])
        self._delivered.clear()

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: a dead worker's jobs come back through the heartbeats (module docstring)."""

    def restore_unacked_once(self, stderr: Any = None) -> None:
        """At close: the acks that came in, then everything still held, back to its queues."""
        if self.channel.connection is None:  # also called at garbage collection
            return
        try:
            self.restore_unacked()
        except (redis.RedisError, *self.channel.connection_errors) as exc:
            log.warning("could not restore the jobs this worker holds: %s", exc)

    def flush_acks(self) -> None:
        """Remove every pending ack's record in one write, then requeue the rejected.

        A failed ack only logs (its finished job is restored once more when
        this worker goes); a failed requeue is kept and tried again in a
        second (or at the next flush).
        """
        with self._acks_lock:
            tags, self._acked = self._acked, []
            requeued, self._requeued = self._requeued, []
        taken = self._link.taken_key
        if tags:
            try:
                with self.channel.conn_or_acquire() as client:
                    client.hdel(taken, *tags)
            except Exception as exc:  # raised into Celery's consumer, it would stop the worker
                log.warning("could not ack %d message(s); to be restored: %s", len(tags), exc)
        for position, tag in enumerate(requeued):
            try:
                with self.channel.conn_or_acquire() as client:
                    RESTORE.bind(client)(keys=[taken], args=["tail", tag])
            except Exception as exc:
                self._retry_requeues(requeued[position:], exc)
                return

    def _retry_requeues(self, tags: list[str], exc: Exception) -> None:
        log.warning("could not requeue %d message(s), to retry: %s", len(tags), exc)
        with self._acks_lock:
            self._requeued = tags + self._requeued
        connection = self.channel.connection
        loop = None if connection is None else connection.event_loop
        if loop is not None:
            loop.call_later(1.0, self.flush_acks)


class Channel(kombu_redis.Channel):
    QoS = QoS

    @cached_property
    def link(self) -> Any:
        """This worker's ``BrokerLink`` (the transport option ``LINK_OPTION``)."""
        return self.connection.client.transport_options[LINK_OPTION]

    def close(self) -> None:
        if self._qos is not None:
            self._qos.flush_acks()  # what the loop has not written yet
        super().close()

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """kombu's push, with the job's wake token after it."""
        batch = kwargs.get("_publish_batch")
        super()._put(queue, message, **kwargs)
        if batch is not None:
            batch.add("lpush", keys.queue_wake(queue), "1")
        else:
            with self.conn_or_acquire() as client:
                client.lpush(keys.queue_wake(queue), "1")

    def _brpop_start(self, timeout: float | None = None) -> None:
        """Block on the queues' wake lists, with the take script sent right behind.

        Redis runs the script as soon as the blocking read returns (a token,
        or the timeout), so waking and taking cost one round trip, not two.
        The credit is this moment's: it can only grow while the read waits
        (acks free slots), and what it misses the next read takes.
        """
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        queues.sort(key=lambda queue: queue != self.link.own_queue)  # own first, else in turn
        wake = [keys.queue_wake(queue) for queue in queues]
        lists = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        credit = self.qos.can_consume_max_estimate()
        timeout = self.brpop_timeout if timeout is None else timeout
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = monotonic()  # kombu's health check drops a reply long overdue
        script_keys = [self.link.taken_key, *wake, *lists]
        wait = ("BRPOP", *wake, timeout or 0)
        take = ("EVALSHA", TAKE.sha, len(script_keys), *script_keys, credit, len(queues))
        connection.send_packed_command(connection.pack_commands([wait, take + START_ARGS]))

    def _brpop_read(self, **options: Any) -> bool:
        """The wake-up's reply, then the take script's: deliver what it took."""
        try:
            connection = self.client.connection
            try:
                self._read_wake_up(connection, **options)
                reply = self.client.parse_response(connection, "EVALSHA")
            except self.connection_errors:
                connection.disconnect()  # the next poll reconnects
                raise
            except redis.exceptions.NoScriptError as exc:  # nothing was popped
                self.client.script_load(TAKE.source)  # Redis restarted: the next poll takes
                raise kombu_redis.Empty() from exc
            except redis.ResponseError as exc:  # refused before any write: the jobs stay queued
                log.warning("could not take jobs from Redis: %s", exc)
                raise kombu_redis.Empty() from exc
            messages = self._received(reply)
            if not messages:
                raise kombu_redis.Empty()
            self._queue_cycle.rotate(self._queue_of(messages[0][0]))
            for key, message in messages:
                self._deliver_one(key, message)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _read_wake_up(self, connection: Any, **options: Any) -> None:
        """The blocking read's reply; an error in it is logged, the script's reply still read."""
        try:
            self.client.parse_response(connection, "BRPOP", **options)
        except redis.ResponseError as exc:  # a wake list of the wrong type: the script says more
            log.warning("the wake-up read failed: %s", exc)

    def _deliver_one(self, key: str, message: dict[str, Any]) -> None:
        """Hand a message to its consumer; an error stays here.

        Raised into the event loop, the error would stop the worker, and the
        message, recorded as taken, would stop the next one. A message that
        never became a kombu message (its body or encoding is malformed) is
        dropped; one whose consumer failed keeps its record, and goes back to
        its queue when this worker leaves or dies (not at once, where it would
        fail again at once).
        """
        tag = _delivery_tag(message)
        try:
            self.connection._deliver(message, self._queue_of(key))
        except Exception:
            if tag is None:  # the take script recorded nothing for it
                log.exception("dropping a message without a delivery tag from %s", key)
            elif tag in self.qos._delivered:
                log.exception("delivering %s failed; it is held until this worker goes", tag)
                VirtualQoS.ack(self.qos, tag)  # frees its credit, keeps its record
            else:
                log.exception("dropping a malformed message from %s: %.200r", key, message)
                self.qos.ack(tag)  # removes its record

    def _received(self, reply: list[Any]) -> list[tuple[str, Any]]:
        """The take script's messages, decoded; their records and starts are written already."""
        taken, started = reply
        for request_id, replies in zip(started[::2], started[1::2], strict=True):
            self.link.starts.put(bytes_to_str(request_id), _taken_start(replies))
        messages = []
        for key, item in zip(taken[::2], taken[1::2], strict=True):
            try:
                messages.append((bytes_to_str(key), loads(bytes_to_str(item))))
            except ValueError:
                log.error("dropping a message that is not JSON from %s: %.200r", key, item)
        return messages

    def _queue_of(self, key: str) -> str:
        return key.rsplit(self.sep, 1)[0]


class Transport(kombu_redis.Transport):
    """Pass as Celery's ``broker_transport`` with a ``redis://`` broker URL."""

    Channel = Channel
    event_loop: Hub | None = None  # the loop polling this connection, if any

    def register_with_event_loop(self, connection: Any, loop: Hub) -> None:
        super().register_with_event_loop(connection, loop)
        self.event_loop = loop
        link = self.client.transport_options[LINK_OPTION]
        link.intake.attach(lambda: loop.call_soon(_nothing))  # an opened intake wakes the loop


def _taken_start(replies: Any) -> TakenStart | Exception:
    """The replies as the task reads them; a script's ``XRANGE`` gives flat field lists."""
    try:
        attempt, cancelled, entries, origin_alive, tag = replies
        if isinstance(entries, list):
            entries = [
                (entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                for entry_id, flat in entries
            ]
    except (TypeError, ValueError) as exc:
        return exc
    return TakenStart(attempt, cancelled, entries, origin_alive, bytes_to_str(tag))


def _delivery_tag(message: dict[str, Any]) -> str | None:
    properties = message.get("properties") if isinstance(message, dict) else None
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    return tag if isinstance(tag, str) else None


def _nothing() -> None:
    """A callback whose only effect is to wake the event loop that runs it."""
