"""kombu's Redis transport, waking on tokens, taking jobs atomically, acking in bursts.

kombu's consumer ``BRPOP``s a message off its queue and then, in a round
trip of its own, records it as unacked (``unacked`` hash + ``unacked_index``).
Between the two the message is in neither place: a worker killed there
(``kill -9``, the OOM killer, a lost node) loses the job, and its client
waits out the queue deadline for nothing. It also took a burst of 32 jobs
one message, and two round trips, at a time: about 1-1.7 ms per job on two
shared cores, 30-50 ms for the last of the burst.

Here a worker blocks on the queues' wake lists instead (``keys.queue_wake``):
every sender pushes one token beside each job, in the same transaction
(the API's submit script, ``requeue_first``, and this transport's own
``_put`` and restore). Popping a token takes nothing; it only wakes the
worker. Sent right behind the blocking read, on the same connection, goes a
script that pops up to the worker's prefetch credit from the queue lists (in
kombu's priority order) and records each popped message as unacked in the
same atomic step; Redis runs it the moment the read returns, so one round
trip both wakes and takes. A job is therefore always in its queue or in the
unacked records, which the redelivery sweep returns to the queue. The script
also sets each wake list to the number of jobs still queued, so tokens never
outnumber jobs (a burst taken at once leaves no spurious wake-ups behind)
and jobs this worker had no credit for keep theirs. A message queued
without a token (a sender using kombu's stock transport, a token lost with
its worker) is taken when the blocking read times out (``brpop_timeout``,
1 s): the script runs then too. The messages are delivered one by one, as
``BRPOP`` would have delivered them; their unacked records are already
written, so ``append`` skips that round trip.

The same script starts each job whose message names it
(``shared.task_message.JOB_HEADER``): it takes the job's next attempt and
reads its cancel flag, its stream so far and whether its API process lives,
what the task thread would otherwise do in a transaction of its own once
Celery handed it the job. The replies wait in ``workers.taken`` for the
task; what is wrong with one job's keys fails that job's start alone.

The credit is Celery's prefetch (the engine's sequence slots) as the read is
sent, and no read is sent while the engine's intake is closed
(``workers.intake``: its KV cache is full). A read already waiting when it
closes is still read and its jobs delivered: they are taken by then.

Unacked records are scored with Redis's clock (``TIME`` in the script), and
the redelivery sweep compares them with Redis's clock too, as the
visibility refresh does (``workers.visibility``): kombu uses each worker's
own clock, so a worker whose clock ran a few seconds ahead swept the jobs
live workers were still running.

Acks go in bursts too. kombu removes an acked message's unacked records in a
round trip of its own, on the consumer's event loop, which meanwhile reads
no new jobs: a burst's 32 acks held it for about 20 ms (sampled at 32
streams, tiny model), enough to delay the next burst. Here an ack frees the
prefetch credit at once and queues the removal; the loop removes everything
acked by then in one write, before it polls again. On a connection no event
loop polls (kombu used directly) an ack writes at once. A lost removal only
means a finished job is redelivered after the visibility timeout, which its
stream's ``Finish`` turns into an immediate ack.

An ack also wakes the loop. Celery's thread pool acks from the task's
thread, and a loop whose credit was all taken polls no queue: it slept until
its next timer (kombu's come a second apart), and the job that a freed slot
could have taken waited in Redis meanwhile. With 32 clients each sending its
next stream as the last one ended, on a worker of 32 slots, the TTFT p50 was
184 ms (p99 742 ms) against 43 ms embedded; woken, 102 ms (p99 193 ms).
"""

from __future__ import annotations

import logging
import threading
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
from shared.task_message import JOB_HEADER
from shared.versions import require
from workers.intake import TRANSPORT_OPTION, Intake
from workers.taken import TRANSPORT_OPTION as TAKEN_OPTION
from workers.taken import TakenStart, TakenStarts

require("celery", "kombu")

log = logging.getLogger(__name__)

UNBOUNDED_BURST = 64  # the most one read takes for a consumer without a prefetch limit
START_ARGS = (  # the take script's arguments to start the jobs it takes (workers.taken)
    keys.lease(""),
    keys.cancel_flag(""),
    keys.event_stream(""),
    keys.api_process(""),
    keys.FINISHED_STREAM_TTL_S,
    JOB_HEADER,
)

TAKE_SCRIPT = """
-- KEYS: unacked index, unacked hash, the queues' wake lists (one per queue), then
-- the queue lists in kombu's BRPOP order: priority-major, so list i (from 0)
-- belongs to queue i % #queues.
-- ARGV: how many messages to pop, the number of queues, then (to start the jobs taken,
-- workers.taken) the key prefixes of leases, cancel flags, event streams and API processes,
-- a lease's TTL and the header naming a message's job.
-- Returns the delivery tags recorded, the messages popped (key, message, ...), and the jobs
-- started (request id, {attempt, cancel flag, stream entries, origin alive}, ...).
-- Runs right after the wake-up read on the same connection, which may or may not have popped
-- a token: it leaves each wake list as long as the jobs still queued, neither more nor fewer.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local queues = tonumber(ARGV[2])
local first_list = 3 + queues
local recorded = {}
local started = {}
local function start(headers)  -- workers.task.begin_all's reads, for a message naming its job
  if #ARGV < 8 or type(headers) ~= 'table' then return end
  local job = headers[ARGV[8]]
  if type(job) ~= 'table' or type(job[1]) ~= 'string' then return end
  local request, origin = job[1], job[2]
  local lease = ARGV[3] .. request
  local attempt = redis.pcall('INCR', lease)  -- an error fails this job alone
  redis.pcall('EXPIRE', lease, ARGV[7])
  local alive = 1
  if type(origin) == 'string' and origin ~= '' then
    alive = redis.pcall('EXISTS', ARGV[6] .. origin)
  end
  local cancelled = redis.pcall('EXISTS', ARGV[4] .. request)
  local entries = redis.pcall('XRANGE', ARGV[5] .. request, '-', '+')
  started[#started + 1] = request
  started[#started + 1] = {attempt, cancelled, entries, alive}
end
local function record(item)
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' then return end
  local properties = message['properties']
  if type(properties) ~= 'table' or type(properties['delivery_tag']) ~= 'string' then return end
  local info = properties['delivery_info']
  if type(info) ~= 'table' then info = {} end
  local exchange = cjson.encode(info['exchange'] or '')
  local routing_key = cjson.encode(info['routing_key'] or '')
  redis.call('ZADD', KEYS[1], now, properties['delivery_tag'])
  redis.call('HSET', KEYS[2], properties['delivery_tag'],
             '[' .. item .. ',' .. exchange .. ',' .. routing_key .. ']')
  recorded[#recorded + 1] = properties['delivery_tag']
  start(message['headers'])
end
local taken = {}
local wanted = tonumber(ARGV[1])
local queued = {}
for q = 1, queues do queued[q] = 0 end
for i = first_list, #KEYS do
  while wanted > 0 do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    record(item)
    taken[#taken + 1] = KEYS[i]
    taken[#taken + 1] = item
    wanted = wanted - 1
  end
  local q = (i - first_list) % queues + 1
  queued[q] = queued[q] + redis.call('LLEN', KEYS[i])
end
for q = 1, queues do
  local wake = KEYS[2 + q]
  local tokens = redis.call('LLEN', wake)
  if queued[q] == 0 then
    redis.call('DEL', wake)
  elseif tokens > queued[q] then
    redis.call('LTRIM', wake, 0, queued[q] - 1)
  elseif tokens < queued[q] then  -- for other workers (this one took what its credit allows)
    for _ = tokens + 1, queued[q] do redis.call('LPUSH', wake, '1') end
  end
end
return {recorded, taken, started}
"""


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS, with the unacked records written and removed in bursts.

    Messages the take script recorded skip kombu's write; acks are removed
    in one write per pass of the event loop, which the first of them wakes.
    A closed intake leaves no credit (see the module docstring).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: set[str] = set()  # delivery tags written by the take script
        self._acked: list[str] = []  # acked tags whose unacked records are still in Redis
        self._acks_lock = threading.Lock()
        self._intake: Intake | None = self.channel.connection.client.transport_options.get(
            TRANSPORT_OPTION
        )

    def can_consume(self) -> bool:
        """A closed intake stops new reads; one in flight is still read.

        Its jobs are taken already (the script ran as its wait ended), and
        kombu leaves a reply it may not consume unread: they would sit in the
        socket, recorded as taken, until the sweep sent them to another
        worker while this one still held them.
        """
        reading = bool(self.channel._in_poll)
        open_ = self._intake is None or self._intake.open or reading
        return open_ and super().can_consume()

    def can_consume_max_estimate(self) -> int:
        if self._intake is not None and not self._intake.open:
            return 0
        estimate = super().can_consume_max_estimate()
        return UNBOUNDED_BURST if estimate is None else estimate

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            VirtualQoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        VirtualQoS.ack(self, delivery_tag)  # the credit is free now
        with self._acks_lock:
            self._acked.append(delivery_tag)
            first = len(self._acked) == 1  # no flush is due yet
        loop = self.channel.connection.event_loop
        if loop is None:
            self.flush_acks()
        elif first:
            loop.call_soon(self.flush_acks)  # from a task thread, this wakes the loop

    def restore_visible(self, start: int = 0, num: int | None = None, interval: int = 10) -> None:
        """kombu's redelivery sweep, with its cut-off read from Redis's clock.

        The records it compares are scored with that clock (the take script,
        the visibility refresh); a worker's own clock may disagree by seconds.
        """
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            seconds, microseconds = client.time()
            ceil = seconds + microseconds / 1e6 - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(
                        self.unacked_index_key, ceil, 0, desc=True, byscore=True,
                        offset=num and start, num=num,
                    )  # fmt: skip
                    for tag in visible:
                        self.restore_by_tag(tag, client)
            except kombu_redis.MutexHeld:
                pass

    def restore_unacked_once(self, stderr: Any = None) -> None:
        """kombu's restore at close, then the acks that came in meanwhile.

        A task thread may ack after close wrote the pending acks: the restore
        skips that job, and its records would stay behind for the sweep.
        """
        super().restore_unacked_once(stderr)
        if self.channel.connection is not None:  # also called at garbage collection
            self.flush_acks()

    def flush_acks(self) -> None:
        """Remove every pending ack's records in one write; a failure only logs."""
        with self._acks_lock:
            tags, self._acked = self._acked, []
        if not tags:
            return
        try:
            with self.channel.conn_or_acquire() as client:
                pipe = client.pipeline()
                pipe.zrem(self.unacked_index_key, *tags).hdel(self.unacked_key, *tags)
                pipe.execute()
        except (redis.RedisError, *self.channel.connection_errors) as exc:
            log.warning("could not ack %d message(s); they will be redelivered: %s", len(tags), exc)


class Channel(kombu_redis.Channel):
    QoS = QoS

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

    def _do_restore_message(
        self, payload: Any, exchange: str, routing_key: str, pipe: Any, leftmost: bool = False
    ) -> None:
        """kombu's restore (a reject, the redelivery sweep), with wake tokens in its transaction."""
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        for queue in self._lookup(exchange, routing_key):
            pipe.lpush(keys.queue_wake(queue), "1")

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
        wake = [keys.queue_wake(queue) for queue in queues]
        lists = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        credit = self.qos.can_consume_max_estimate()
        timeout = self.brpop_timeout if timeout is None else timeout
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = monotonic()
        script_keys = [self.unacked_index_key, self.unacked_key, *wake, *lists]
        wait = ("BRPOP", *wake, timeout or 0)
        take = ("EVAL", TAKE_SCRIPT, len(script_keys), *script_keys, credit, len(queues))
        if self._taken is not None:
            take += START_ARGS
        connection.send_packed_command(connection.pack_commands([wait, take]))

    def _brpop_read(self, **options: Any) -> bool:
        """The wake-up's reply, then the take script's: deliver what it took."""
        try:
            connection = self.client.connection
            try:
                self.client.parse_response(connection, "BRPOP", **options)
                reply = self.client.parse_response(connection, "EVAL")
            except self.connection_errors:
                connection.disconnect()  # the next poll reconnects
                raise
            except redis.ResponseError as exc:  # nothing was popped: the jobs stay queued
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

    def _deliver_one(self, key: str, message: dict[str, Any]) -> None:
        """Hand a message to its consumer; an error stays here.

        Raised into the event loop, the error would stop the worker, and the
        message, recorded as taken, would come back after the visibility
        timeout to stop the next one. A message that never became a kombu
        message (its body or encoding is malformed) is dropped; one whose
        consumer failed is left recorded, for the sweep to redeliver.
        """
        tag = _delivery_tag(message)
        try:
            self.connection._deliver(message, self._queue_of(key))
        except Exception:
            if tag is None:  # the take script recorded nothing for it
                log.exception("dropping a message without a delivery tag from %s", key)
                return
            self.qos.recorded.discard(tag)
            if tag in self.qos._delivered:
                log.exception("delivering %s failed; the sweep redelivers it", tag)
                VirtualQoS.ack(self.qos, tag)  # frees its credit, keeps its record
            else:
                log.exception("dropping a malformed message from %s: %.200r", key, message)
                self.qos.ack(tag)  # removes its record

    @cached_property
    def _taken(self) -> TakenStarts | None:
        return self.connection.client.transport_options.get(TAKEN_OPTION)

    def _received(self, reply: list[Any]) -> list[tuple[str, Any]]:
        """The take script's messages, decoded; their records and starts are written already."""
        recorded, taken, started = reply
        self.qos.recorded.update(bytes_to_str(tag) for tag in recorded)
        for request_id, replies in zip(started[::2], started[1::2], strict=True):
            try:
                self._taken.put(bytes_to_str(request_id), _taken_start(*replies))
            except (TypeError, ValueError) as exc:  # its task starts it again
                log.error("ignoring the start of %s: %s", request_id, exc)
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
        intake: Intake | None = self.client.transport_options.get(TRANSPORT_OPTION)
        if intake is not None:  # an opened intake wakes the loop to poll for jobs again
            intake.attach(lambda: loop.call_soon(_nothing))


def _taken_start(attempt: Any, cancelled: Any, entries: Any, origin_alive: Any) -> TakenStart:
    """The replies as ``begin_all`` reads them: a script's ``XRANGE`` gives flat field lists."""
    if isinstance(entries, list):
        entries = [
            (entry_id, dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in entries
        ]
    return TakenStart(attempt, cancelled, entries, origin_alive)


def _delivery_tag(message: dict[str, Any]) -> str | None:
    properties = message.get("properties") if isinstance(message, dict) else None
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    return tag if isinstance(tag, str) else None


def _nothing() -> None:
    """A callback whose only effect is to wake the event loop that runs it."""
