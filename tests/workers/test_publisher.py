"""Fenced publishing: only the current attempt's events reach a stream."""

from __future__ import annotations

import uuid

import redis

from shared import keys
from shared.event_codec import Entry, decode_entry
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text
from shared.registry import DEFAULT_MODEL
from workers.publisher import REFRESH_EVERY, Batch, EventPublisher


def _request(client: redis.Redis, attempt: int) -> str:
    request_id = uuid.uuid4().hex
    client.set(keys.lease(request_id), attempt)
    return request_id


def _stream(client: redis.Redis, request_id: str) -> list[Entry]:
    entries = client.xrange(keys.event_stream(request_id))
    return [decode_entry(request_id, fields) for _, fields in entries]


def test_current_attempt_writes_and_stale_attempt_is_dropped(client: redis.Redis) -> None:
    publisher = EventPublisher(client, DEFAULT_MODEL)
    current, stale = _request(client, 2), _request(client, 3)
    events = [Ready(current, 5, 0), Text(current, "Hi", [42])]

    fenced = publisher.publish(
        [
            Batch(current, 2, 1, events),
            Batch(stale, 2, 1, [Ready(stale, 5, 0), Text(stale, "no", [7])]),
        ]
    )

    assert fenced == {(stale, 2)}
    assert _stream(client, current) == [Entry(2, seq, event) for seq, event in enumerate(events, 1)]
    assert not client.exists(keys.event_stream(stale))


def test_a_missing_lease_fences_everyone_out(client: redis.Redis) -> None:
    request_id = uuid.uuid4().hex
    fenced = EventPublisher(client, DEFAULT_MODEL).publish(
        [Batch(request_id, 1, 1, [Ready(request_id, 1, 0)])]
    )
    assert fenced == {(request_id, 1)}
    assert not client.exists(keys.event_stream(request_id))


def test_the_stream_and_its_lease_keep_expiring_while_written(client: redis.Redis) -> None:
    """A stream whose writer dies mid-generation must not stay behind forever."""
    publisher = EventPublisher(client, DEFAULT_MODEL, ttl_s=100)
    request_id = _request(client, 1)
    stream, lease = keys.event_stream(request_id), keys.lease(request_id)

    def write(seq: int, *events: InferenceEvent) -> tuple[int, int]:
        client.persist(stream)
        client.persist(lease)
        publisher.publish([Batch(request_id, 1, seq, list(events))])
        return client.ttl(stream), client.ttl(lease)

    assert min(write(1, Ready(request_id, 3, 0), Text(request_id, "a", [1]))) > 0  # the first
    assert write(3, Text(request_id, "b", [2])) == (-1, -1)  # not every write: it costs
    filler = [Text(request_id, "c", [3])] * (REFRESH_EVERY - 3)
    assert min(write(4, *filler, Text(request_id, "d", [4]))) > 0  # reaches the next refresh
    assert min(write(REFRESH_EVERY + 2, Finish(request_id, FinishReason.STOP, 1, 2))) > 0
    assert max(client.ttl(stream), client.ttl(lease)) <= 100


def test_a_repeated_write_adds_only_the_events_not_written_yet(client: redis.Redis) -> None:
    """A write sent again after its reply was lost: the script ran once already."""
    publisher = EventPublisher(client, DEFAULT_MODEL)
    request_id = _request(client, 1)
    first = [Ready(request_id, 3, 0), Text(request_id, "a", [1])]
    publisher.publish([Batch(request_id, 1, 1, first)])

    publisher.publish([Batch(request_id, 1, 1, first)])
    later = [Text(request_id, "b", [2]), Finish(request_id, FinishReason.STOP, 2, 3)]
    publisher.publish([Batch(request_id, 1, 1, [*first, *later])])  # merged with what was queued

    assert _stream(client, request_id) == [
        Entry(1, seq, event) for seq, event in enumerate([*first, *later], 1)
    ]


def test_a_new_attempt_numbers_its_events_from_one(client: redis.Redis) -> None:
    publisher = EventPublisher(client, DEFAULT_MODEL)
    request_id = _request(client, 1)
    publisher.publish(
        [Batch(request_id, 1, 1, [Ready(request_id, 3, 0), Text(request_id, "a", [1])])]
    )
    client.set(keys.lease(request_id), 2)

    publisher.publish([Batch(request_id, 2, 1, [Text(request_id, "b", [2])])])

    assert [(entry.attempt, entry.seq) for entry in _stream(client, request_id)] == [
        (1, 1),
        (1, 2),
        (2, 1),
    ]


def test_the_script_is_reloaded_after_the_server_forgets_it(client: redis.Redis) -> None:
    publisher = EventPublisher(client, DEFAULT_MODEL)
    request_id = _request(client, 1)
    client.script_flush()  # what a Redis restart does to the script cache

    assert publisher.publish([Batch(request_id, 1, 1, [Ready(request_id, 3, 0)])]) == set()
    assert _stream(client, request_id) == [Entry(1, 1, Ready(request_id, 3, 0))]


def test_a_split_write_sends_the_script_itself_after_the_server_forgets_it(
    client: redis.Redis,
) -> None:
    publisher = EventPublisher(client, DEFAULT_MODEL)
    connection = publisher.connection()
    current, stale = _request(client, 1), _request(client, 2)
    batches = [
        Batch(current, 1, 1, [Ready(current, 3, 0)]),
        Batch(stale, 1, 1, [Ready(stale, 3, 0)]),
    ]
    client.script_flush()
    try:
        publisher.send(connection, batches)
        fenced = publisher.receive(connection, batches)
    finally:
        connection.disconnect()

    assert fenced == {(stale, 1)}
    assert _stream(client, current) == [Entry(1, 1, Ready(current, 3, 0))]


def test_a_request_s_end_takes_it_out_of_the_in_flight_set(client: redis.Redis) -> None:
    """So an API that died before reading the end leaves no phantom load on the model's bound."""
    publisher = EventPublisher(client, DEFAULT_MODEL)
    inflight = keys.inflight(DEFAULT_MODEL)
    running, ending, stale = _request(client, 1), _request(client, 1), _request(client, 2)
    client.zadd(inflight, {running: 1e12, ending: 1e12, stale: 1e12})

    publisher.publish(
        [
            Batch(running, 1, 1, [Ready(running, 3, 0), Text(running, "a", [1])]),
            Batch(ending, 1, 1, [Text(ending, "b", [2]), Finish(ending, FinishReason.STOP, 1, 2)]),
            Batch(stale, 1, 1, [Finish(stale, FinishReason.STOP, 1, 2)]),
        ]
    )

    assert {member.decode() for member in client.zrange(inflight, 0, -1)} == {running, stale}
