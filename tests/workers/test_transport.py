"""The worker's broker transport wakes on tokens, takes a burst in one atomic step that
records each message in the worker's own taken records and starts each job it names,
puts messages back where they were, and writes the acks of one event-loop iteration
together.

A real Redis and kombu's own producer and consumer, over ``workers.broker.transport``.
Each test uses a queue and a worker id of its own, so the session's worker never sees
these messages and no test reads another's records.
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue as queues
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.asynchronous.timer import Timer
from kombu.transport.redis import Channel as KombuChannel

from shared import keys
from shared.event_codec import decode_entry, encode_event
from shared.events import Ready, Text
from shared.task_message import REQUEST_HEADER, priority_list
from tests.workers.conftest import wait_until
from workers.broker import BrokerLink
from workers.broker.app import broker_transport_options, create_app
from workers.broker.scripts import TAKE
from workers.broker.taken import TakenStart
from workers.broker.transport import LINK_OPTION, UNBOUNDED_BURST, Transport, _taken_start


class Record(NamedTuple):
    """One entry of a worker's taken records: where its message goes back, and the message."""

    wake: str
    list: str
    message: bytes


def _new_queue() -> Queue:
    name = f"transport-test-{uuid.uuid4().hex}"
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def _forget_queue(client: redis.Redis, name: str) -> None:
    lists = [priority_list(name, step) for step in KombuChannel.priority_steps]
    bindings = [f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}"]  # its exchange's
    client.delete(*lists, keys.queue_wake(name), *bindings)


def _connect(url: str, link: BrokerLink) -> Connection:
    return Connection(url, transport=Transport, transport_options=broker_transport_options(link))


@pytest.fixture
def queue(client: redis.Redis) -> Iterator[Queue]:
    declared = _new_queue()
    yield declared
    _forget_queue(client, declared.name)


@pytest.fixture
def link(queue: Queue, client: redis.Redis) -> Iterator[BrokerLink]:
    """This test's worker (set up after its queue, so torn down before the queue is deleted)."""
    worker = BrokerLink(f"transport-test-{uuid.uuid4().hex}")
    yield worker
    client.delete(worker.taken_key)


@pytest.fixture
def connection(redis_url: str, link: BrokerLink) -> Iterator[Connection]:
    with _connect(redis_url, link) as conn:
        yield conn


@pytest.fixture
def request_ids(client: redis.Redis) -> Iterator[Callable[[], str]]:
    """New request ids; their leases, cancel flags and streams are deleted afterwards."""
    made: list[str] = []

    def new() -> str:
        made.append(uuid.uuid4().hex)
        return made[-1]

    yield new
    for request_id in made:
        client.delete(
            keys.lease(request_id), keys.cancel_flag(request_id), keys.event_stream(request_id)
        )


def _publish(connection: Connection, queue: Queue, count: int, priority: int = 0) -> list[str]:
    bodies = [f"{queue.name}-{priority}-{index}-{uuid.uuid4().hex[:6]}" for index in range(count)]
    with connection.channel() as channel:
        producer = Producer(channel)
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue], priority=priority)  # fmt: skip
    return bodies


def _consume_once(connection: Connection, queue: Queue, prefetch: int) -> list:
    """Every message the first ``drain_events`` delivers (left unacked)."""
    received: list = []
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    with Consumer(channel, queues=[queue], callbacks=[lambda _, message: received.append(message)]):
        connection.drain_events(timeout=5)
    return received


def _payloads(messages: list) -> list[str]:
    return [message.payload for message in messages]


def _queued(client: redis.Redis, name: str, priority: int = 0) -> list[bytes]:
    """A queue list's raw messages, next to be taken first."""
    return list(reversed(client.lrange(priority_list(name, priority), 0, -1)))


def _body(raw: bytes) -> str:
    """The payload of a raw message kombu published."""
    return base64.b64decode(json.loads(raw)["body"]).decode()  # a str is sent as text/plain


def _records(client: redis.Redis, link: BrokerLink) -> dict[str, Record]:
    records = {}
    for tag, value in client.hgetall(link.taken_key).items():
        wake, list_key, message = value.split(b"\n", 2)
        records[tag.decode()] = Record(wake.decode(), list_key.decode(), message)
    return records


def _tokens(client: redis.Redis, queue: Queue) -> int:
    return client.llen(keys.queue_wake(queue.name))


# --- taking a burst -------------------------------------------------------------------


def test_the_app_hands_its_link_to_the_transport(redis_url: str) -> None:
    link = BrokerLink("app-test")
    app = create_app(redis_url, ["app-test-queue"], 4, link)

    assert app.conf.broker_transport is Transport
    assert app.conf.broker_transport_options[LINK_OPTION] is link
    assert link.taken_key == keys.taken("app-test") == f"{keys.TAKEN_PREFIX}app-test"


def test_one_read_takes_the_burst_up_to_the_prefetch_credit(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    bodies = _publish(connection, queue, 10)

    received = _consume_once(connection, queue, prefetch=6)

    assert _payloads(received) == bodies[:6]  # oldest first, as BRPOP
    assert client.llen(queue.name) == 4  # the rest wait for credit (or another worker)


def test_a_consumer_without_a_prefetch_limit_takes_a_bounded_burst(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    bodies = _publish(connection, queue, UNBOUNDED_BURST + 3)

    received = _consume_once(connection, queue, prefetch=0)

    assert _payloads(received) == bodies[:UNBOUNDED_BURST]
    assert client.llen(queue.name) == _tokens(client, queue) == 3


def test_taken_messages_are_recorded_in_the_workers_own_taken_records(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    _publish(connection, queue, 5)
    raws = _queued(client, queue.name)

    received = _consume_once(connection, queue, prefetch=10)

    assert len(received) == 5
    records = _records(client, link)
    assert set(records) == {message.delivery_tag for message in received}
    for message, raw in zip(received, raws, strict=True):
        record = records[message.delivery_tag]
        assert record.message == raw  # byte for byte what was queued: restore puts it back
        assert json.loads(record.message) == message._raw
        assert (record.wake, record.list) == (keys.queue_wake(queue.name), queue.name)


def test_a_taken_message_is_in_the_taken_records_before_its_reply_is_read(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """Popped and recorded in one step: a worker that dies with the reply unread loses nothing.

    kombu's own ``BRPOP`` left the message in the dead consumer's socket buffer, in
    neither its queue nor any record.
    """
    bodies = _publish(connection, queue, 3)
    raws = _queued(client, queue.name)
    received: list = []
    channel = connection.channel()
    channel.basic_qos(prefetch_count=10)
    with Consumer(channel, queues=[queue], callbacks=[lambda _, m: received.append(m)]):
        connection.transport.cycle._register_BRPOP(channel)  # sends the read and the take
        wait_until(lambda: client.llen(queue.name) == 0, 5, "the take script")

        assert received == []  # nothing read yet...
        assert sorted(record.message for record in _records(client, link).values()) == sorted(raws)

        connection.drain_events(timeout=5)  # ...and the reply already sent is read now
    assert _payloads(received) == bodies
    assert len(_records(client, link)) == 3


def test_a_job_is_never_in_neither_its_queue_nor_a_taken_record(
    redis_url: str, queue: Queue, client: redis.Redis
) -> None:
    """Snapshots taken in transactions while consumers take: each job queued or recorded once.

    Only a job its consumer acked (and noted before acking) may be in neither place.
    """
    with Connection(redis_url, transport=Transport) as producer:
        _publish(producer, queue, 60)
    raws = Counter(_queued(client, queue.name))
    tag_of = {raw: json.loads(raw)["properties"]["delivery_tag"] for raw in raws}
    links = [BrokerLink(f"transport-test-{uuid.uuid4().hex}") for _ in range(3)]
    acked: set[str] = set()
    done = threading.Event()

    def consume(link: BrokerLink) -> None:
        with _connect(redis_url, link) as connection:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=4)

            def on_message(_: object, message: Any) -> None:
                time.sleep(0.005)
                acked.add(message.delivery_tag)
                message.ack()

            with Consumer(channel, queues=[queue], callbacks=[on_message]):
                while not done.is_set():
                    with contextlib.suppress(TimeoutError):
                        connection.drain_events(timeout=0.2)

    consumers = [threading.Thread(target=consume, args=(link,)) for link in links]
    for consumer in consumers:
        consumer.start()
    snapshots = 0
    try:
        deadline = time.monotonic() + 20
        while len(acked) < len(raws) and time.monotonic() < deadline:
            pipe = client.pipeline(transaction=True)
            pipe.lrange(queue.name, 0, -1)
            for link in links:
                pipe.hvals(link.taken_key)
            queued, *held = pipe.execute()
            acked_by_now = set(acked)
            seen = Counter(queued)
            for values in held:
                seen.update(value.split(b"\n", 2)[2] for value in values)
            assert all(count == 1 for count in seen.values()), "a job in two places"
            assert set(seen) <= set(raws)
            lost = {raw for raw in raws if raw not in seen and tag_of[raw] not in acked_by_now}
            assert not lost, "a job neither queued nor recorded"
            snapshots += 1
    finally:
        done.set()
        for consumer in consumers:
            consumer.join(20)
        client.delete(*(link.taken_key for link in links))
    assert len(acked) == len(raws) and snapshots > 1


def test_higher_priorities_are_taken_first(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    low = _publish(connection, queue, 2, priority=9)
    high = _publish(connection, queue, 2, priority=0)

    received = _consume_once(connection, queue, prefetch=3)

    assert _payloads(received) == high + low[:1]
    lists = {record.list for record in _records(client, link).values()}
    assert lists == {queue.name, priority_list(queue.name, 9)}  # each goes back to its own list


def test_each_record_names_the_wake_list_and_queue_list_of_its_own_queue(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    other = _new_queue()
    try:
        ours = _publish(connection, queue, 2, priority=9)
        theirs = _publish(connection, other, 2, priority=0)

        channel = connection.channel()
        channel.basic_qos(prefetch_count=10)
        received: list = []
        with Consumer(channel, queues=[queue, other], callbacks=[lambda _, m: received.append(m)]):
            deadline = time.monotonic() + 5
            while len(received) < 4 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    connection.drain_events(timeout=1)

        assert sorted(_payloads(received)) == sorted(ours + theirs)
        by_body = {_body(record.message): record for record in _records(client, link).values()}
        for body in ours:
            assert by_body[body][:2] == (keys.queue_wake(queue.name), priority_list(queue.name, 9))
        for body in theirs:
            assert by_body[body][:2] == (keys.queue_wake(other.name), other.name)

        channel.close()  # everything back where it came from, with its own queue's tokens
        assert sorted(map(_body, _queued(client, queue.name, 9))) == sorted(ours)
        assert sorted(map(_body, _queued(client, other.name))) == sorted(theirs)
        assert _tokens(client, queue) == _tokens(client, other) == 2
    finally:
        _forget_queue(client, other.name)


def test_a_message_that_is_not_json_is_dropped_without_losing_the_burst(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    good = _publish(connection, queue, 2)
    client.lpush(queue.name, "not json")
    more = _publish(connection, queue, 1)

    received = _consume_once(connection, queue, prefetch=10)

    assert _payloads(received) == good + more
    assert client.llen(queue.name) == 0
    assert set(_records(client, link)) == {message.delivery_tag for message in received}


def _forged(client: redis.Redis, queue: Queue, **changes: Any) -> Any:
    """Queue a copy of the queue's last message, with a tag of its own and ``changes``."""
    message = json.loads(client.lindex(queue.name, 0))
    tag = message["properties"]["delivery_tag"] = uuid.uuid4().hex
    message.update(changes)
    client.lpush(queue.name, json.dumps(message))
    client.lpush(keys.queue_wake(queue.name), "1")
    return tag


def test_a_malformed_message_is_dropped_and_its_record_removed_without_losing_the_burst(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """Raised into the loop it would stop the worker, and come back to stop the next one."""
    good = _publish(connection, queue, 1)
    bad = _forged(client, queue, body="%%% not base64 %%%")
    more = _publish(connection, queue, 1)

    received = _consume_once(connection, queue, prefetch=10)

    assert _payloads(received) == good + more
    assert bad not in _records(client, link)
    assert set(_records(client, link)) == {message.delivery_tag for message in received}
    assert received[0].channel.qos.can_consume_max_estimate() == 8  # its credit is free


def test_a_message_whose_consumer_fails_keeps_its_record_until_the_worker_goes(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
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

    assert _payloads(received) == [second]
    held = {_body(record.message) for record in _records(client, link).values()}
    assert held == {first, second}  # not put back at once, where it would fail again at once
    assert client.llen(queue.name) == 0
    assert channel.qos.can_consume_max_estimate() == 9  # its credit is free again

    channel.close()  # the worker goes: what it held goes back
    assert sorted(map(_body, _queued(client, queue.name))) == sorted([first, second])
    assert client.exists(link.taken_key) == 0


def test_a_numeric_delivery_tag_is_recorded_and_restored_like_any_other(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """kombu writes string tags; a number (another producer's) is recorded by its digits."""
    _publish(connection, queue, 1)
    odd = json.loads(client.lindex(queue.name, 0))
    odd["properties"]["delivery_tag"] = 12345
    client.lpush(queue.name, json.dumps(odd))
    more = _publish(connection, queue, 1)

    received = _consume_once(connection, queue, prefetch=10)

    assert [message.delivery_tag for message in received][1] == 12345
    assert len(received) == 3 and received[2].payload == more[0]
    assert "12345" in _records(client, link)
    connection.close()  # the worker goes: what it held goes back
    assert client.hlen(link.taken_key) == 0 and client.llen(queue.name) == 3


def test_a_key_of_the_wrong_type_takes_nothing_and_keeps_the_connection_in_step(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """The script refuses before any write; the wake-up and the script's replies both read."""
    bodies = _publish(connection, queue, 2)
    client.set(link.taken_key, "clobbered")

    with pytest.raises(TimeoutError):  # nothing to deliver
        _consume_once(connection, queue, prefetch=4)
    assert client.llen(queue.name) == 2  # nothing popped

    client.delete(link.taken_key)
    received = _consume_once(connection, queue, prefetch=4)
    assert sorted(_payloads(received)) == sorted(bodies)


def test_a_worker_killed_between_waking_and_taking_loses_no_job(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """A consumer pops a token, never a job: dying with the token loses only the wake-up."""
    bodies = _publish(connection, queue, 1)
    woke = client.brpop([keys.queue_wake(queue.name)], timeout=1)  # ...and the consumer dies
    assert woke is not None
    assert client.llen(queue.name) == 1

    received = _consume_once(connection, queue, prefetch=4)  # woken by its read's timeout

    assert _payloads(received) == bodies
    assert received[0].delivery_tag in _records(client, link)


# --- wake tokens ----------------------------------------------------------------------


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


def test_a_batch_publish_pushes_a_token_beside_each_job(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    bodies = [f"{queue.name}-batch-{index}" for index in range(3)]
    with connection.channel() as channel:
        producer = Producer(channel)
        queue(channel).declare()
        with producer.batch():
            for body in bodies:
                producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key)
            assert client.llen(queue.name) == 0  # buffered until the batch ends

    assert _tokens(client, queue) == client.llen(queue.name) == 3
    assert _payloads(_consume_once(connection, queue, prefetch=10)) == bodies


def test_a_job_queued_without_a_token_is_taken_when_the_read_times_out(
    redis_url: str, connection: Connection, queue: Queue
) -> None:
    with Connection(redis_url) as stock:  # kombu's own transport pushes no token
        bodies = _publish(stock, queue, 2)

    received = _consume_once(connection, queue, prefetch=4)

    assert _payloads(received) == bodies


def test_a_job_beyond_the_credit_keeps_its_token_for_another_worker(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    _publish(connection, queue, 3)
    client.delete(keys.queue_wake(queue.name))  # sent without tokens (kombu's stock producer)

    received = _consume_once(connection, queue, prefetch=2)

    assert len(received) == 2
    assert _tokens(client, queue) == client.llen(queue.name) == 1


def test_consumers_of_different_workers_racing_for_a_burst_take_each_job_once(
    redis_url: str, queue: Queue, client: redis.Redis
) -> None:
    with Connection(redis_url, transport=Transport) as producer:
        bodies = _publish(producer, queue, 30)
    links = [BrokerLink(f"transport-test-{uuid.uuid4().hex}") for _ in range(3)]
    taken: queues.Queue = queues.Queue()

    def consume(link: BrokerLink) -> None:
        with _connect(redis_url, link) as connection:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=4)

            def on_message(_: object, message: Any) -> None:
                taken.put((link.worker_id, message.payload))
                message.ack()

            with Consumer(channel, queues=[queue], callbacks=[on_message]):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and client.llen(queue.name):
                    with contextlib.suppress(TimeoutError):  # socket.timeout, too
                        connection.drain_events(timeout=0.5)

    consumers = [threading.Thread(target=consume, args=(link,)) for link in links]
    try:
        for consumer in consumers:
            consumer.start()
        for consumer in consumers:
            consumer.join(20)

        received = [taken.get_nowait() for _ in range(taken.qsize())]
        assert sorted(body for _, body in received) == sorted(bodies)  # none lost, none twice
        assert len({worker for worker, _ in received}) > 1  # they did race
        assert client.exists(queue.name, keys.queue_wake(queue.name)) == 0
        assert client.exists(*(link.taken_key for link in links)) == 0  # all acked
    finally:
        client.delete(*(link.taken_key for link in links))


# --- putting messages back ------------------------------------------------------------


def test_an_ack_removes_the_record(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    _publish(connection, queue, 3)
    received = _consume_once(connection, queue, prefetch=10)

    received[1].ack()  # no event loop polls this connection: the ack writes at once

    assert set(_records(client, link)) == {received[0].delivery_tag, received[2].delivery_tag}
    assert received[1].channel.qos.can_consume_max_estimate() == 8
    for message in (received[0], received[2]):
        message.ack()
    assert client.exists(link.taken_key) == 0

    received[0].channel.close()
    assert client.llen(queue.name) == 0  # acked: nothing to restore at close


def test_a_rejected_and_requeued_message_goes_to_the_tail_of_its_queue(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    first, *rest = _publish(connection, queue, 3)
    (message,) = _consume_once(connection, queue, prefetch=1)
    assert message.payload == first and _tokens(client, queue) == 2

    message.reject(requeue=True)

    assert [_body(raw) for raw in _queued(client, queue.name)] == [*rest, first]
    assert _tokens(client, queue) == 3
    assert client.exists(link.taken_key) == 0
    assert message.channel.qos.can_consume_max_estimate() == 1  # its credit is free
    assert _payloads(_consume_once(connection, queue, prefetch=3)) == [*rest, first]


def test_a_requeue_redis_refuses_is_sent_again_with_the_next_write(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Refused (Redis away), the requeue is kept, not lost with the record left behind."""
    first, second = _publish(connection, queue, 2)
    one, two = _consume_once(connection, queue, prefetch=2)
    records = client.hgetall(link.taken_key)
    client.delete(link.taken_key)
    client.set(link.taken_key, "not a hash")  # the restore fails with WRONGTYPE

    one.reject(requeue=True)
    assert "could not requeue 1 message(s)" in caplog.text
    assert client.llen(queue.name) == 0

    client.delete(link.taken_key)
    client.hset(link.taken_key, mapping=records)  # Redis answers again
    two.ack()  # the next write

    assert _payloads([one]) == [first] and [_body(raw) for raw in _queued(client, queue.name)] == [
        first
    ]
    assert client.exists(link.taken_key) == 0 and second


def test_an_earlier_delivery_s_ack_leaves_the_record_of_the_same_message_taken_again(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """Back in its queue and taken again by this worker, a message keeps its tag: the record
    is the later delivery's, which the earlier one (fenced out, acking late) must not remove."""
    _publish(connection, queue, 1)
    channel = connection.channel()
    channel.basic_qos(prefetch_count=4)
    received: list = []
    with Consumer(channel, queues=[queue], callbacks=[lambda _, message: received.append(message)]):
        connection.drain_events(timeout=5)
        channel.qos.restore_by_tag(received[0].delivery_tag)  # as a hand-back would
        connection.drain_events(timeout=5)
    earlier, later = received
    assert earlier.delivery_tag == later.delivery_tag

    earlier.ack()
    assert client.hlen(link.taken_key) == 1  # still the later delivery's

    later.ack()
    assert client.hlen(link.taken_key) == 0


def test_a_sent_read_is_dated_for_kombu_s_health_check(
    connection: Connection, queue: Queue
) -> None:
    """kombu drops a consumer connection whose read is long overdue, if it knows when it went."""
    _publish(connection, queue, 1)
    (message,) = _consume_once(connection, queue, prefetch=1)

    assert message.channel._brpop_sent_at is not None


def test_a_rejected_message_not_requeued_is_dropped_like_an_acked_one(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    _publish(connection, queue, 1)
    (message,) = _consume_once(connection, queue, prefetch=1)

    message.reject(requeue=False)

    assert client.exists(link.taken_key, queue.name) == 0
    message.channel.close()
    assert client.llen(queue.name) == 0


def test_a_message_restored_by_tag_goes_to_the_head_of_its_queue(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    first, *rest = _publish(connection, queue, 3)
    (message,) = _consume_once(connection, queue, prefetch=1)

    message.channel.qos.restore_by_tag(message.delivery_tag)

    assert [_body(raw) for raw in _queued(client, queue.name)] == [first, *rest]
    assert _tokens(client, queue) == 3
    assert client.exists(link.taken_key) == 0
    assert _payloads(_consume_once(connection, queue, prefetch=3)) == [first, *rest]


def test_a_message_restored_by_tag_leftmost_goes_to_the_tail(
    connection: Connection, queue: Queue, client: redis.Redis
) -> None:
    first, *rest = _publish(connection, queue, 3)
    (message,) = _consume_once(connection, queue, prefetch=1)

    message.channel.qos.restore_by_tag(message.delivery_tag, leftmost=True)

    assert [_body(raw) for raw in _queued(client, queue.name)] == [*rest, first]


def test_restoring_a_tag_no_longer_held_does_nothing(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    _publish(connection, queue, 1)
    (message,) = _consume_once(connection, queue, prefetch=1)
    message.ack()

    message.channel.qos.restore_by_tag(message.delivery_tag)

    assert client.exists(queue.name, keys.queue_wake(queue.name), link.taken_key) == 0


def test_closing_the_channel_returns_every_held_message_to_the_head_with_its_token(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    bodies = _publish(connection, queue, 5)
    held = _consume_once(connection, queue, prefetch=3)
    assert _payloads(held) == bodies[:3] and _tokens(client, queue) == 2
    held[0].ack()

    held[0].channel.close()

    queued = [_body(raw) for raw in _queued(client, queue.name)]
    assert sorted(queued[:2]) == sorted(bodies[1:3])  # back at the head, ahead of the rest
    assert queued[2:] == bodies[3:]
    assert _tokens(client, queue) == 4
    assert client.exists(link.taken_key) == 0
    received = _consume_once(connection, queue, prefetch=10)
    assert sorted(_payloads(received)[:2]) == sorted(bodies[1:3])
    assert _payloads(received)[2:] == bodies[3:]


def test_the_restore_at_close_returns_the_records_of_earlier_reads_too(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """Every record of the worker goes back, not only what this channel delivered."""
    bodies = _publish(connection, queue, 4)
    earlier = _consume_once(connection, queue, prefetch=2)
    later = _consume_once(connection, queue, prefetch=2)
    assert len(_records(client, link)) == 4

    later[0].channel.close()

    assert earlier[0].channel is not later[0].channel
    assert sorted(map(_body, _queued(client, queue.name))) == sorted(bodies)
    assert _tokens(client, queue) == 4 and client.exists(link.taken_key) == 0


def test_the_visibility_sweep_puts_nothing_back(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """A dead worker's jobs come back through the heartbeats; live workers keep theirs."""
    _publish(connection, queue, 2)
    received = _consume_once(connection, queue, prefetch=10)

    received[0].channel.qos.restore_visible(start=0, num=10, interval=1)

    assert client.llen(queue.name) == 0 and len(_records(client, link)) == 2


# --- acks in bursts -------------------------------------------------------------------


@pytest.fixture
def event_loop_hub(connection: Connection) -> Iterator[Hub]:
    """A kombu event loop polling ``connection``, as the Celery consumer's polls its own."""
    hub = Hub()
    connection.transport.register_with_event_loop(connection.connection, hub)
    try:
        yield hub
    finally:
        hub.close()


def _hdel_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_hdel", {}).get("calls", 0))


def test_acks_of_one_loop_iteration_are_written_together_before_it_polls(
    quiet_redis_url: str, queue: Queue
) -> None:
    link = BrokerLink(f"transport-test-{uuid.uuid4().hex}")
    client = redis.Redis.from_url(quiet_redis_url)
    hub = Hub()
    with _connect(quiet_redis_url, link) as connection:
        connection.transport.register_with_event_loop(connection.connection, hub)
        _publish(connection, queue, 5)
        received = _consume_once(connection, queue, prefetch=5)
        qos = received[0].channel.qos
        writes_before = _hdel_calls(client)

        for message in received:
            message.ack()

        assert qos.can_consume_max_estimate() == 5  # the credit is back at once
        assert len(_records(client, link)) == 5  # the records go with the loop's next pass
        hub.run_once()  # one pass of the loop
        assert _hdel_calls(client) == writes_before + 1
        assert client.exists(link.taken_key) == 0
    hub.close()
    client.close()


@contextlib.contextmanager
def sleepy_loop(
    connection: Connection, queue: Queue, prefetch: int
) -> Iterator[tuple[queues.Queue, Any]]:
    """A consumer on a running kombu event loop that, unless woken, sleeps 10 s per poll.

    Yields the queue its messages arrive on, and its channel. The transport's own
    timers (which would wake the loop every second) are cleared, and one timer far
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


def test_an_ack_from_a_task_thread_wakes_a_loop_that_has_no_credit(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """With all its credit taken the loop polls for no job; the ack that frees one must wake it.

    Celery's thread pool acks from the task's thread while the loop sleeps in its
    poll for as long as its next timer allows, and the next job would wait in Redis
    that long.
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
        assert set(_records(client, link)) == {second.delivery_tag}  # the ack was written
        second.ack()


def test_closing_the_channel_writes_the_pending_acks(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    event_loop_hub: Hub,
) -> None:  # fmt: skip
    _publish(connection, queue, 2)
    received = _consume_once(connection, queue, prefetch=5)
    for message in received:
        message.ack()
    assert len(_records(client, link)) == 2  # pending: the loop has not run

    received[0].channel.close()

    assert client.exists(link.taken_key) == 0
    assert client.llen(queue.name) == 0  # acked: not restored


def test_an_ack_that_arrives_while_the_channel_closes_is_written_too(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    event_loop_hub: Hub,
) -> None:  # fmt: skip
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

    assert client.exists(link.taken_key) == 0
    assert client.llen(queue.name) == 0  # acked: not restored either


def test_what_redis_refuses_at_ack_or_close_is_logged_not_raised(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    _publish(connection, queue, 1)
    (message,) = _consume_once(connection, queue, prefetch=5)
    client.delete(link.taken_key)
    client.set(link.taken_key, "not a hash")  # HDEL and the restore fail with WRONGTYPE

    message.ack()
    assert "to be restored" in caplog.text

    message.channel.close()
    assert "could not restore" in caplog.text


def test_an_ack_after_the_channel_closed_does_not_raise_into_the_consumer(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    event_loop_hub: Hub,
) -> None:  # fmt: skip
    """Redis went away and kombu closed the channel; a task thread acks what it finished."""
    _publish(connection, queue, 1)
    (message,) = _consume_once(connection, queue, prefetch=5)
    qos = message.channel.qos
    message.channel.close()  # its connection is None from here on
    assert message.channel.connection is None

    qos.ack(message.delivery_tag)  # as Celery's ack of a fenced-out run: no AttributeError

    assert client.hlen(link.taken_key) == 0


# --- the engine's intake --------------------------------------------------------------


def test_a_closed_intake_takes_nothing_and_loses_no_wake_token(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    bodies = _publish(connection, queue, 2)
    link.intake.set(False)  # the engine waits for KV blocks
    channel = connection.channel()
    channel.basic_qos(prefetch_count=4)
    assert channel.qos.can_consume_max_estimate() == 0 and not channel.qos.can_consume()

    with Consumer(channel, queues=[queue]), pytest.raises(TimeoutError):  # no read is sent
        connection.drain_events(timeout=0.5)
    assert _tokens(client, queue) == client.llen(queue.name) == 2
    assert client.exists(link.taken_key) == 0
    channel.close()

    link.intake.set(True)
    received = _consume_once(connection, queue, prefetch=4)
    assert _payloads(received) == bodies


def test_an_intake_that_opens_wakes_the_loop_to_take_jobs(
    redis_url: str, connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """The loop's socket stays registered while the intake is closed: only a wake ends its poll."""
    with sleepy_loop(connection, queue, prefetch=4) as (received, channel):
        wait_until(lambda: channel._in_poll, 5, "the loop to wait on the wake list")
        link.intake.set(False)  # the engine waits for KV blocks
        wait_until(lambda: not channel._in_poll, 5, "the read to time out")  # no new read sent
        with Connection(redis_url, transport=Transport) as producer:
            bodies = _publish(producer, queue, 1)
        time.sleep(0.5)  # the loop is in its poll, taking nothing
        assert received.empty() and client.llen(queue.name) == 1

        link.intake.set(True)  # from another thread, as the engine thread opens it

        assert received.get(timeout=3).payload == bodies[0]


def test_a_read_waiting_when_the_intake_closes_still_delivers_what_it_took(
    redis_url: str, connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    """The script behind the read took the job as the read returned: it must not sit unread."""
    with sleepy_loop(connection, queue, prefetch=4) as (received, channel):
        wait_until(lambda: channel._in_poll, 5, "the loop to wait on the wake list")
        link.intake.set(False)
        with Connection(redis_url, transport=Transport) as producer:
            bodies = _publish(producer, queue, 1)

        message = received.get(timeout=3)
        assert message.payload == bodies[0]
        assert client.exists(queue.name, keys.queue_wake(queue.name)) == 0
        assert set(_records(client, link)) == {message.delivery_tag}


# --- redis forgets the script ---------------------------------------------------------


def _noscript_errors(client: redis.Redis) -> int:
    return int(client.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0))


def test_a_script_redis_forgot_is_loaded_again_and_the_next_poll_takes_the_jobs(
    quiet_redis_url: str,
) -> None:
    """``SCRIPT FLUSH`` (or a restarted Redis): the read that hits NOSCRIPT takes nothing."""
    queue = _new_queue()
    link = BrokerLink(f"transport-test-{uuid.uuid4().hex}")
    client = redis.Redis.from_url(quiet_redis_url)
    with _connect(quiet_redis_url, link) as connection:
        first = _publish(connection, queue, 1)
        assert _payloads(_consume_once(connection, queue, prefetch=10)) == first
        client.script_flush()
        assert client.script_exists(TAKE.sha) == [False]
        errors_before = _noscript_errors(client)
        bodies = _publish(connection, queue, 2)

        received = _consume_once(connection, queue, prefetch=10)

        assert _noscript_errors(client) == errors_before + 1  # one read refused...
        assert _payloads(received) == bodies  # ...and the next took both
        assert client.script_exists(TAKE.sha) == [True]
        assert len(_records(client, link)) == 3
        assert client.exists(queue.name, keys.queue_wake(queue.name)) == 0
    client.close()


# --- starting the jobs it takes (workers.broker.taken) --------------------------------


def _publish_named(connection: Connection, queue: Queue, request_id: str, origin: str) -> None:
    with connection.channel() as channel:
        Producer(channel).publish(
            request_id, exchange=queue.exchange, routing_key=queue.routing_key,
            declare=[queue], headers={REQUEST_HEADER: [request_id, origin]},
        )  # fmt: skip


def test_a_job_is_started_in_the_step_that_takes_its_message(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    request_ids: Callable[[], str],
) -> None:  # fmt: skip
    request_id, origin = request_ids(), uuid.uuid4().hex
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
    start = link.starts.pop(request_id)
    assert isinstance(start, TakenStart) and len(link.starts) == 0
    assert (start.attempt, start.cancelled, start.origin_alive) == (3, 1, 0)  # origin key unset
    assert start.delivery_tag == message.delivery_tag  # its record, for a hand-back to delete
    assert [decode_entry(request_id, fields).event for _, fields in start.entries] == written

    client.set(keys.api_process(origin), "1")
    try:
        _publish_named(connection, queue, request_id, origin)
        _consume_once(connection, queue, prefetch=10)
        again = link.starts.pop(request_id)
        assert isinstance(again, TakenStart)
        assert (again.attempt, again.origin_alive) == (4, 1)
    finally:
        client.delete(keys.api_process(origin))


def test_what_is_wrong_with_one_job_of_a_burst_fails_its_start_alone(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis,
    request_ids: Callable[[], str],
) -> None:  # fmt: skip
    clobbered, fine = request_ids(), request_ids()
    client.set(keys.event_stream(clobbered), "not a stream")
    _publish_named(connection, queue, clobbered, "")
    _publish_named(connection, queue, fine, "")

    received = _consume_once(connection, queue, prefetch=10)

    assert _payloads(received) == [clobbered, fine]  # both delivered
    assert len(_records(client, link)) == 2  # and both recorded
    broken = link.starts.pop(clobbered)
    assert isinstance(broken, TakenStart) and isinstance(broken.entries, redis.ResponseError)
    assert broken.attempt == 1  # what could be read was
    fine_tag = received[1].delivery_tag
    assert link.starts.pop(fine) == TakenStart(1, 0, [], 1, fine_tag)  # no origin: none gone


def test_a_message_that_does_not_name_its_job_is_taken_unstarted(
    connection: Connection, queue: Queue, link: BrokerLink, client: redis.Redis
) -> None:
    (body,) = _publish(connection, queue, 1)

    (message,) = _consume_once(connection, queue, prefetch=10)

    assert message.payload == body and len(link.starts) == 0
    assert client.get(keys.lease(body)) is None
    assert set(_records(client, link)) == {message.delivery_tag}  # taken all the same


def test_replies_that_cannot_be_read_leave_the_reason_as_the_start() -> None:
    assert isinstance(_taken_start([1, 0]), ValueError)
    assert isinstance(_taken_start(None), TypeError)
    assert isinstance(_taken_start([1, 0, [[b"1-0", [b"odd"]]], 1, b"t"]), ValueError)
    assert _taken_start([2, 0, [[b"1-0", [b"k", b"v"]]], 1, b"t"]) == TakenStart(
        2, 0, [(b"1-0", {b"k": b"v"})], 1, "t"
    )


def test_a_worker_takes_its_own_queue_first_at_each_priority(
    redis_url: str, client: redis.Redis, queue: Queue
) -> None:
    """The shared queue's urgent job still goes before the own queue's less urgent one."""
    own = _new_queue()
    link = BrokerLink(f"transport-test-{uuid.uuid4().hex}", own_queue=own.name)
    try:
        with _connect(redis_url, link) as connection:
            [own_late] = _publish(connection, own, 1, priority=6)
            [shared_first] = _publish(connection, queue, 1, priority=0)
            [own_first] = _publish(connection, own, 1, priority=0)
            received: list = []
            channel = connection.channel()
            channel.basic_qos(prefetch_count=3)
            callbacks = [lambda _, message: received.append(message)]
            with Consumer(channel, queues=[queue, own], callbacks=callbacks):
                connection.drain_events(timeout=5)
            assert _payloads(received) == [own_first, shared_first, own_late]
    finally:
        _forget_queue(client, own.name)
        client.delete(link.taken_key)
