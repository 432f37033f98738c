"""The worker's broker transport wakes on tokens, takes a burst in one atomic read,
records it as kombu would, sweeps by Redis's clock, and writes the acks of one
event-loop iteration together.

A real Redis and kombu's own producer and consumer, over ``workers.transport``.
Each test uses a queue of its own, so the session's worker never sees these
messages.
"""

from __future__ import annotations

import contextlib
import json
import queue as queues
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.asynchronous.timer import Timer
from kombu.transport.redis import Channel as KombuChannel

from shared import keys
from shared.event_codec import decode_entry, encode_event
from shared.events import Ready, Text
from shared.task_message import JOB_HEADER
from tests.workers.conftest import wait_until
from workers.intake import TRANSPORT_OPTION, Intake
from workers.taken import TRANSPORT_OPTION as TAKEN_OPTION
from workers.taken import TakenStart, TakenStarts
from workers.transport import Transport
from workers.visibility import DeliveryTracker

UNACKED, UNACKED_INDEX = KombuChannel.unacked_key, KombuChannel.unacked_index_key


@pytest.fixture
def queue() -> Queue:
    name = f"transport-test-{uuid.uuid4().hex}"
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


@pytest.fixture
def connection(redis_url: str) -> Iterator[Connection]:
    with Connection(redis_url, transport=Transport) as conn:
        yield conn


def _publish(connection: Connection, queue: Queue, count: int, priority: int = 0) -> list[str]:
    bodies = [f"{queue.name}-{priority}-{index}" for index in range(count)]
    with connection.channel() as channel:
        producer = Producer(channel)
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue], priority=priority)  # fmt: skip
    return bodies


def _consume_once(connection: Connection, queue: Queue, prefetch: int) -> list:
    """Every message the first ``drain_events`` delivers."""
    received: list = []
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    with Consumer(channel, queues=[queue], callbacks=[lambda _, message: received.append(message)]):
        connection.drain_events(timeout=5)
    return received


def test_one_read_takes_the_burst_up_to_the_prefetch_credit(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    bodies = _publish(connection, queue, 10)

    received = _consume_once(connection, queue, prefetch=6)

    assert [message.payload for message in received] == bodies[:6]  # oldest first, as BRPOP
    assert client.llen(queue.name) == 4  # the rest wait for credit (or another worker)


def test_taken_messages_are_recorded_as_kombu_records_them(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    _publish(connection, queue, 5)

    received = _consume_once(connection, queue, prefetch=10)

    assert len(received) == 5
    for message in received:
        tag = message.delivery_tag
        assert client.zscore(UNACKED_INDEX, tag) is not None
        raw, exchange, routing_key = json.loads(client.hget(UNACKED, tag))
        assert raw == message._raw  # what kombu's restore puts back in the queue
        assert (exchange, routing_key) == (queue.exchange.name, queue.routing_key)
    for message in received:
        message.ack()
        assert client.hget(UNACKED, message.delivery_tag) is None
        assert client.zscore(UNACKED_INDEX, message.delivery_tag) is None


def test_a_taken_message_is_restored_to_its_queue_like_any_unacked_one(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    _publish(connection, queue, 3)
    received = _consume_once(connection, queue, prefetch=10)
    assert client.llen(queue.name) == 0

    channel = received[0].channel
    for message in received:
        channel.qos.restore_by_tag(message.delivery_tag, leftmost=True)

    assert client.llen(queue.name) == 3
    assert all(client.hget(UNACKED, message.delivery_tag) is None for message in received)


def test_higher_priorities_are_taken_first(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    low = _publish(connection, queue, 2, priority=9)
    high = _publish(connection, queue, 2, priority=0)

    received = _consume_once(connection, queue, prefetch=3)

    assert [message.payload for message in received] == high + low[:1]


def test_a_message_that_is_not_json_is_dropped_without_losing_the_burst(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    good = _publish(connection, queue, 2)
    client.lpush(queue.name, "not json")
    more = _publish(connection, queue, 1)

    received = _consume_once(connection, queue, prefetch=10)

    assert [message.payload for message in received] == good + more
    assert client.llen(queue.name) == 0


def _forged(client: redis.Redis, queue: Queue, **changes: Any) -> str:
    """Queue a copy of the queue's last message, with a tag of its own and ``changes``."""
    message = json.loads(client.lindex(queue.name, 0))
    tag = message["properties"]["delivery_tag"] = uuid.uuid4().hex
    message.update(changes)
    client.lpush(queue.name, json.dumps(message))
    client.lpush(keys.queue_wake(queue.name), "1")
    return tag


def test_a_malformed_message_is_dropped_and_forgotten_without_losing_the_burst(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    """Raised into the loop it would stop the worker, and come back to stop the next one."""
    good = _publish(connection, queue, 1)
    bad = _forged(client, queue, body="%%% not base64 %%%")
    more = _publish(connection, queue, 1)

    received = _consume_once(connection, queue, prefetch=10)

    assert [message.payload for message in received] == good + more
    assert client.hget(UNACKED, bad) is None and client.zscore(UNACKED_INDEX, bad) is None


def test_a_message_whose_consumer_fails_stays_recorded_for_the_sweep(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    first, second = _publish(connection, queue, 2)
    received: list = []

    def consume(body: str, message: Any) -> None:
        if body == first:
            raise RuntimeError("a consumer bug")
        received.append(message)

    channel = connection.channel()
    channel.basic_qos(prefetch_count=10)
    with Consumer(channel, queues=[queue], callbacks=[consume]):
        connection.drain_events(timeout=5)

    assert [message.payload for message in received] == [second]
    records = client.hgetall(UNACKED).items()
    ours = {tag.decode() for tag, record in records if queue.name.encode() in record}
    failed = ours - {received[0].delivery_tag}
    assert len(failed) == 1  # the sweep puts it back after the visibility timeout
    assert channel.qos.can_consume_max_estimate() == 9  # its credit is free again


def test_a_message_the_script_cannot_record_is_recorded_by_kombu(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    _publish(connection, queue, 1)
    odd = json.loads(client.lindex(queue.name, 0))
    odd["properties"]["delivery_tag"] = 12345  # not a string: the script leaves it to kombu
    client.lpush(queue.name, json.dumps(odd))

    received = _consume_once(connection, queue, prefetch=10)

    assert [message.delivery_tag for message in received][1] == 12345
    for message in received:
        assert client.hget(UNACKED, str(message.delivery_tag)) is not None
        assert client.zscore(UNACKED_INDEX, str(message.delivery_tag)) is not None


def test_a_worker_killed_between_waking_and_taking_loses_no_job(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    """A consumer pops a token, never a job: dying with the token loses only the wake-up.

    With kombu's own ``BRPOP`` of the queue list, the job itself was in the
    dead consumer's socket buffer, in neither the queue nor ``unacked``.
    """
    bodies = _publish(connection, queue, 1)
    woke = client.brpop([keys.queue_wake(queue.name)], timeout=1)  # ...and the consumer dies
    assert woke is not None
    assert client.llen(queue.name) == 1

    received = _consume_once(connection, queue, prefetch=4)  # woken by its read's timeout

    assert [message.payload for message in received] == bodies
    assert client.hget(UNACKED, received[0].delivery_tag) is not None


def test_wake_tokens_never_outnumber_the_queued_jobs(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    wake = keys.queue_wake(queue.name)
    _publish(connection, queue, 10)
    assert client.llen(wake) == 10

    _consume_once(connection, queue, prefetch=6)
    assert client.llen(wake) == client.llen(queue.name) == 4  # one read took six

    _consume_once(connection, queue, prefetch=6)
    assert client.exists(wake, queue.name) == 0


def test_a_job_queued_without_a_token_is_taken_when_the_read_times_out(
    redis_url: str, connection: Connection, queue: Queue
) -> None:
    with Connection(redis_url) as stock:  # kombu's own transport pushes no token
        bodies = _publish(stock, queue, 2)

    received = _consume_once(connection, queue, prefetch=4)

    assert [message.payload for message in received] == bodies


def test_restored_jobs_come_back_with_their_wake_tokens(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    _publish(connection, queue, 2)
    received = _consume_once(connection, queue, prefetch=4)
    assert client.exists(keys.queue_wake(queue.name)) == 0

    for message in received:
        message.channel.qos.restore_by_tag(message.delivery_tag, leftmost=True)

    assert client.llen(keys.queue_wake(queue.name)) == client.llen(queue.name) == 2


def test_the_sweep_and_the_records_keep_to_redis_clock(
    redis_url: str, queue: Queue, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose clock runs an hour ahead neither sweeps live jobs nor misses dead ones."""
    index, unacked = f"{queue.name}-index", f"{queue.name}-unacked"  # the worker's stay intact
    options = {"unacked_index_key": index, "unacked_key": unacked, "visibility_timeout": 2}
    monkeypatch.setattr("kombu.transport.redis.time", lambda: time.time() + 3600)
    with Connection(redis_url, transport=Transport, transport_options=options) as connection:
        _publish(connection, queue, 1)
        received = _consume_once(connection, queue, prefetch=4)
        qos = received[0].channel.qos
        seconds, microseconds = client.time()
        assert client.zscore(index, received[0].delivery_tag) == pytest.approx(
            seconds + microseconds / 1e6, abs=1
        )

        qos.restore_visible(interval=1)
        assert client.llen(queue.name) == 0  # taken just now, by Redis's clock

        tracker = DeliveryTracker(index)
        tracker.received("task", received[0].delivery_tag)
        time.sleep(1.5)
        pipe = client.pipeline()
        tracker.renew(pipe)
        pipe.execute()
        time.sleep(1.0)
        qos.restore_visible(interval=1)
        assert client.llen(queue.name) == 0  # taken 2.5 s ago, but renewed 1 s ago

        time.sleep(1.3)
        qos.restore_visible(interval=1)
        assert client.llen(queue.name) == 1  # 2.3 s since the last sign of life: swept
    client.delete(index, unacked)


def test_consumers_racing_for_a_burst_take_each_job_once_and_leave_no_token(
    redis_url: str, queue: Queue, client: redis.Redis
) -> None:
    bodies = set()
    with Connection(redis_url, transport=Transport) as producer:
        bodies.update(_publish(producer, queue, 30))
    taken: queues.Queue = queues.Queue()

    def consume() -> None:
        with Connection(redis_url, transport=Transport) as connection:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=4)

            def on_message(_: object, message: Any) -> None:
                taken.put(message.payload)
                message.ack()

            with Consumer(channel, queues=[queue], callbacks=[on_message]):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and client.llen(queue.name):
                    with contextlib.suppress(TimeoutError):  # socket.timeout, too
                        connection.drain_events(timeout=0.5)

    consumers = [threading.Thread(target=consume) for _ in range(3)]
    for consumer in consumers:
        consumer.start()
    for consumer in consumers:
        consumer.join(20)

    received = [taken.get_nowait() for _ in range(taken.qsize())]
    assert sorted(received) == sorted(bodies)  # every job once: none lost, none twice
    assert client.exists(queue.name, keys.queue_wake(queue.name)) == 0


def test_a_closed_intake_takes_nothing_and_loses_no_wake_token(
    redis_url: str, queue: Queue, client: redis.Redis
) -> None:
    intake = Intake()
    options = {TRANSPORT_OPTION: intake}
    with Connection(redis_url, transport=Transport, transport_options=options) as connection:
        bodies = _publish(connection, queue, 2)
        intake.set(False)  # the engine waits for KV blocks
        channel = connection.channel()
        channel.basic_qos(prefetch_count=4)
        assert channel.qos.can_consume_max_estimate() == 0 and not channel.qos.can_consume()

        with Consumer(channel, queues=[queue]), pytest.raises(TimeoutError):  # no read is sent
            connection.drain_events(timeout=0.5)
        assert client.llen(keys.queue_wake(queue.name)) == client.llen(queue.name) == 2
        channel.close()

        intake.set(True)
        received = _consume_once(connection, queue, prefetch=4)
    assert [message.payload for message in received] == bodies


@contextlib.contextmanager
def sleepy_loop(
    connection: Connection, queue: Queue, prefetch: int
) -> Iterator[tuple[queues.Queue, Any]]:
    """A consumer on a running kombu event loop that, unless woken, sleeps 10 s per poll.

    Yields the queue its messages arrive on, and its channel. The transport's own timers
    (which would wake the loop every second) are cleared, and one timer far
    off leaves the poll kombu's longest wait.
    """
    hub = Hub(Timer(max_interval=60))
    connection.transport.register_with_event_loop(connection.connection, hub)
    hub.timer.clear()
    hub.call_later(60, lambda: None)
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    received: queues.Queue = queues.Queue()
    consumer = Consumer(channel, queues=[queue], callbacks=[lambda _, m: received.put(m)])
    consumer.consume()
    loop = threading.Thread(target=hub.run_forever, daemon=True)
    loop.start()
    try:
        yield received, channel
    finally:
        hub.stop()
        loop.join(timeout=15)
        hub.close()


def test_an_intake_that_opens_wakes_the_loop_to_take_jobs(
    redis_url: str, queue: Queue, client: redis.Redis
) -> None:
    intake = Intake()
    intake.set(False)
    options = {TRANSPORT_OPTION: intake}
    with Connection(redis_url, transport=Transport, transport_options=options) as connection:
        bodies = _publish(connection, queue, 1)
        with sleepy_loop(connection, queue, prefetch=4) as (received, _):
            time.sleep(0.3)  # the loop is in its poll, taking nothing
            assert received.empty() and client.llen(queue.name) == 1

            intake.set(True)  # from another thread, as the engine thread opens it

            assert received.get(timeout=3).payload == bodies[0]


def test_a_read_waiting_when_the_intake_closes_still_delivers_what_it_took(
    redis_url: str, queue: Queue, client: redis.Redis
) -> None:
    """The script behind the read took the job as the read returned: it must not sit unread."""
    intake = Intake()
    options = {TRANSPORT_OPTION: intake}
    connection = Connection(redis_url, transport=Transport, transport_options=options)
    with connection, sleepy_loop(connection, queue, prefetch=4) as (received, channel):
        wait_until(lambda: channel._in_poll, 5, "the loop to wait on the wake list")
        intake.set(False)
        with Connection(redis_url, transport=Transport) as producer:
            bodies = _publish(producer, queue, 1)

        assert received.get(timeout=3).payload == bodies[0]
        assert client.exists(queue.name, keys.queue_wake(queue.name)) == 0


def test_a_job_beyond_the_credit_keeps_its_token_for_another_worker(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    _publish(connection, queue, 3)
    client.delete(keys.queue_wake(queue.name))  # sent without tokens (kombu's stock producer)

    received = _consume_once(connection, queue, prefetch=2)

    assert len(received) == 2
    assert client.llen(keys.queue_wake(queue.name)) == client.llen(queue.name) == 1


@pytest.fixture
def event_loop_hub(connection: Connection) -> Iterator[Hub]:
    """A kombu event loop polling ``connection``, as the Celery consumer's polls its own."""
    hub = Hub()
    connection.transport.register_with_event_loop(connection.connection, hub)
    try:
        yield hub
    finally:
        hub.close()


def _zrem_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_zrem", {}).get("calls", 0))


def test_acks_of_one_loop_iteration_are_written_together_before_it_polls(
    quiet_redis_url: str, queue: Queue
) -> None:
    connection = Connection(quiet_redis_url, transport=Transport)
    client = redis.Redis.from_url(quiet_redis_url)
    event_loop_hub = Hub()
    connection.transport.register_with_event_loop(connection.connection, event_loop_hub)
    _publish(connection, queue, 5)
    received = _consume_once(connection, queue, prefetch=5)
    qos = received[0].channel.qos
    writes_before = _zrem_calls(client)

    for message in received:
        message.ack()

    assert qos.can_consume_max_estimate() == 5  # the credit is back at once
    assert all(client.hget(UNACKED, message.delivery_tag) for message in received)
    event_loop_hub.run_once()  # one pass of the loop
    assert _zrem_calls(client) == writes_before + 1
    for message in received:
        assert client.hget(UNACKED, message.delivery_tag) is None
        assert client.zscore(UNACKED_INDEX, message.delivery_tag) is None
    event_loop_hub.close()
    connection.close()
    client.close()


def test_an_ack_from_a_task_thread_wakes_a_loop_that_has_no_credit(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    """With all its credit taken the loop polls for no job; the ack that frees one must wake it.

    Celery's thread pool acks from the task's thread while the loop sleeps in
    its poll for as long as its next timer allows (up to 10 s), and the next
    job would wait in Redis that long.
    """
    _publish(connection, queue, 2)
    with sleepy_loop(connection, queue, prefetch=1) as (received, _):
        first = received.get(timeout=5)
        time.sleep(0.2)  # the loop is back in its poll, with no credit for the second job
        acker = threading.Thread(target=first.ack)
        acker.start()
        acker.join()

        second = received.get(timeout=3)

        assert second.body != first.body
        second.ack()


def test_closing_the_channel_writes_the_pending_acks(
    connection: Connection, queue: Queue, client: redis.Redis, event_loop_hub: Hub
) -> None:
    _publish(connection, queue, 2)
    received = _consume_once(connection, queue, prefetch=5)
    for message in received:
        message.ack()

    received[0].channel.close()

    assert all(client.hget(UNACKED, message.delivery_tag) is None for message in received)


def test_an_ack_that_arrives_while_the_channel_closes_is_written_too(
    connection: Connection, queue: Queue, client: redis.Redis, event_loop_hub: Hub
) -> None:
    """A task thread acks after close wrote the pending acks, before it restored the rest."""
    _publish(connection, queue, 1)
    (message,) = _consume_once(connection, queue, prefetch=5)
    qos = message.channel.qos
    restore = qos.restore_unacked_once

    def ack_then_restore(*args: Any, **kwargs: Any) -> Any:
        message.ack()  # as from a task thread, mid-close
        return restore(*args, **kwargs)

    qos.restore_unacked_once = ack_then_restore
    message.channel.close()

    assert client.hget(UNACKED, message.delivery_tag) is None
    assert client.llen(queue.name) == 0  # acked: not restored either


def test_an_ack_redis_refuses_is_logged_not_raised_into_the_loop(
    redis_url: str, queue: Queue, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    index, unacked = f"{queue.name}-index", f"{queue.name}-unacked"  # the worker's stay intact
    options = {"unacked_index_key": index, "unacked_key": unacked}
    with Connection(redis_url, transport=Transport, transport_options=options) as connection:
        _publish(connection, queue, 1)
        received = _consume_once(connection, queue, prefetch=5)
        client.delete(index)
        client.set(index, "not a sorted set")  # ZREM fails with WRONGTYPE

        received[0].ack()

    assert "will be redelivered" in caplog.text
    client.delete(index, unacked)


# --- starting the jobs it takes (workers.taken) ------------------------------------


def _publish_named(connection: Connection, queue: Queue, request_id: str, origin: str) -> None:
    with connection.channel() as channel:
        Producer(channel).publish(
            request_id, exchange=queue.exchange, routing_key=queue.routing_key,
            declare=[queue], headers={JOB_HEADER: [request_id, origin]},
        )  # fmt: skip


@pytest.fixture
def starting(redis_url: str) -> Iterator[tuple[Connection, TakenStarts]]:
    """A connection whose take script starts the jobs it takes, and where it leaves them."""
    taken = TakenStarts()
    options = {TAKEN_OPTION: taken}
    with Connection(redis_url, transport=Transport, transport_options=options) as conn:
        yield conn, taken


def test_a_job_is_started_in_the_step_that_takes_its_message(
    starting: tuple[Connection, TakenStarts], queue: Queue, client: redis.Redis
) -> None:
    connection, taken = starting
    request_id, origin = uuid.uuid4().hex, uuid.uuid4().hex
    client.set(keys.lease(request_id), 2)  # two attempts before this one
    client.set(keys.cancel_flag(request_id), "1")
    written = [Ready(request_id, 7, 0), Text(request_id, "hi", [5, 6])]
    for seq, event in enumerate(written, 1):
        client.xadd(keys.event_stream(request_id), encode_event(event, 2, seq))
    _publish_named(connection, queue, request_id, origin)

    (message,) = _consume_once(connection, queue, prefetch=10)

    assert message.payload == request_id
    assert client.get(keys.lease(request_id)) == b"3"  # fences attempt 2 out from here on
    assert 0 < client.ttl(keys.lease(request_id)) <= keys.FINISHED_STREAM_TTL_S
    start = taken.pop(request_id)
    assert start is not None and len(taken) == 0
    assert (start.attempt, start.cancelled, start.origin_alive) == (3, 1, 0)  # origin key unset
    assert [decode_entry(request_id, fields).event for _, fields in start.entries] == written
    client.set(keys.api_process(origin), "1")
    _publish_named(connection, queue, request_id, origin)
    _consume_once(connection, queue, prefetch=10)
    assert taken.pop(request_id).origin_alive == 1  # type: ignore[union-attr]


def test_what_is_wrong_with_one_job_of_a_burst_fails_its_start_alone(
    starting: tuple[Connection, TakenStarts], queue: Queue, client: redis.Redis
) -> None:
    connection, taken = starting
    clobbered, fine = uuid.uuid4().hex, uuid.uuid4().hex
    client.set(keys.event_stream(clobbered), "not a stream")
    _publish_named(connection, queue, clobbered, "")
    _publish_named(connection, queue, fine, "")

    received = _consume_once(connection, queue, prefetch=10)

    assert [message.payload for message in received] == [clobbered, fine]  # both delivered
    assert isinstance(taken.pop(clobbered).entries, redis.ResponseError)  # type: ignore[union-attr]
    assert taken.pop(fine) == TakenStart(1, 0, [], 1)  # no origin: nobody to be gone


def test_a_message_that_does_not_name_its_job_is_taken_unstarted(
    starting: tuple[Connection, TakenStarts], queue: Queue, client: redis.Redis
) -> None:
    connection, taken = starting
    (body,) = _publish(connection, queue, 1)

    (message,) = _consume_once(connection, queue, prefetch=10)

    assert message.payload == body and len(taken) == 0
    assert client.get(keys.lease(body)) is None


def test_a_consumer_with_nowhere_to_leave_starts_starts_nothing(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    request_id = uuid.uuid4().hex
    _publish_named(connection, queue, request_id, "")

    (message,) = _consume_once(connection, queue, prefetch=10)

    assert message.payload == request_id
    assert client.get(keys.lease(request_id)) is None  # its task takes the attempt itself
