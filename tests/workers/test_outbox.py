"""The publishing thread: order kept across coalesced writes, no hole after a failed write."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid

import redis

from shared import keys
from shared.event_codec import decode_entry
from shared.events import Finish, FinishReason, Ready, Text
from shared.registry import DEFAULT_MODEL
from tests.servers import free_port
from workers.outbox import Attempt, Outbox
from workers.publisher import WRITER_NAME, Batch, EventPublisher
from workers.runtime import connect


class Results:
    """What the outbox reported, write by write."""

    def __init__(self) -> None:
        self.writes: list[tuple[list[Batch], set[Attempt], redis.RedisError | None]] = []
        self.lock = threading.Lock()

    def __call__(
        self, batches: list[Batch], fenced: set[Attempt], error: redis.RedisError | None
    ) -> None:
        with self.lock:
            self.writes.append((batches, fenced, error))


def _request(client: redis.Redis, attempt: int) -> str:
    request_id = uuid.uuid4().hex
    client.set(keys.lease(request_id), attempt)
    return request_id


def _texts(client: redis.Redis, request_id: str) -> list[str]:
    entries = client.xrange(keys.event_stream(request_id))
    events = [decode_entry(request_id, fields).event for _, fields in entries]
    return [event.text for event in events if isinstance(event, Text)]


def test_steps_are_written_in_order_and_coalesced(client: redis.Redis) -> None:
    results = Results()
    outbox = Outbox(EventPublisher(client, DEFAULT_MODEL), results)
    request_ids = [_request(client, 1) for _ in range(4)]
    outbox.start()
    try:
        for step in range(200):
            outbox.put(
                [Batch(rid, 1, step + 1, [Text(rid, f"{step},", [step])]) for rid in request_ids]
            )
        assert outbox.flush(timeout=10)
    finally:
        outbox.stop(timeout=10)

    expected = [f"{step}," for step in range(200)]
    for rid in request_ids:
        assert _texts(client, rid) == expected
    # 200 steps were put faster than one round trip each: later writes carry several.
    assert len(results.writes) < 200
    assert all(error is None and not fenced for _, fenced, error in results.writes)


def test_a_stale_attempt_is_fenced_beside_the_current_one(client: redis.Redis) -> None:
    results = Results()
    outbox = Outbox(EventPublisher(client, DEFAULT_MODEL), results)
    rid = _request(client, 2)
    outbox.start()
    outbox.put([Batch(rid, 1, 1, [Text(rid, "stale", [1])])])
    outbox.put([Batch(rid, 2, 1, [Ready(rid, 3, 0), Text(rid, "current", [2])])])
    assert outbox.flush(timeout=10)
    outbox.stop(timeout=10)

    fenced = set().union(*(f for _, f, _ in results.writes))
    assert fenced == {(rid, 1)}
    assert _texts(client, rid) == ["current"]


def test_after_a_failed_write_an_attempt_writes_nothing_more() -> None:
    """A later write of the same attempt would leave a hole where the lost events were."""
    results = Results()
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1)
    outbox = Outbox(EventPublisher(unreachable, DEFAULT_MODEL), results)
    outbox.start()
    try:
        outbox.put([Batch("lost", 1, 1, [Text("lost", "a", [1])])])
        assert outbox.flush(timeout=10)
        outbox.put([Batch("lost", 1, 2, [Finish("lost", FinishReason.STOP, 1, 1)])])
        outbox.put([Batch("other", 1, 1, [Text("other", "b", [2])])])
        assert outbox.flush(timeout=10)
    finally:
        outbox.stop(timeout=10)

    tried = [[(b.request_id, b.attempt) for b in batches] for batches, _, _ in results.writes]
    assert tried == [[("lost", 1)], [("other", 1)]]
    assert all(isinstance(error, redis.ConnectionError) for _, _, error in results.writes)


class SendingThreads(EventPublisher):
    """The real publisher, noting which thread sent each write."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client, DEFAULT_MODEL)
        self.threads: list[str] = []

    def send(self, connection: redis.Connection, batches, **options: bool) -> None:  # noqa: ANN001
        self.threads.append(threading.current_thread().name)
        super().send(connection, batches, **options)


def test_an_idle_outbox_sends_the_step_on_the_engine_thread(client: redis.Redis) -> None:
    """The writer thread would wait for the core and GIL the engine thread holds."""
    publisher = SendingThreads(client)
    outbox = Outbox(publisher, Results())
    rid = _request(client, 1)
    outbox.start()
    try:
        outbox.put([Batch(rid, 1, 1, [Text(rid, "first,", [1])])])  # connects: the thread's
        assert outbox.flush(timeout=10)
        outbox.put([Batch(rid, 1, 2, [Text(rid, "second,", [2])])])
        assert outbox.flush(timeout=10)
    finally:
        outbox.stop(timeout=10)

    assert publisher.threads == ["sluice-outbox", threading.current_thread().name]
    assert _texts(client, rid) == ["first,", "second,"]


def _writers(client: redis.Redis) -> set[str]:
    return {entry["id"] for entry in client.client_list() if entry["name"] == WRITER_NAME}


def test_a_write_whose_connection_dropped_is_sent_again_on_a_new_one(
    client: redis.Redis,
) -> None:
    """As redis-py's retry did; after a Redis restart it is then fenced out, not failed."""
    results = Results()
    outbox = Outbox(EventPublisher(client, DEFAULT_MODEL), results)
    rid = _request(client, 1)
    others = _writers(client)
    outbox.start()
    try:
        outbox.put([Batch(rid, 1, 1, [Text(rid, "a", [1])])])
        assert outbox.flush(timeout=10)
        (own,) = _writers(client) - others
        client.client_kill_filter(_id=own)
        outbox.put([Batch(rid, 1, 2, [Text(rid, "b", [2])])])  # sent on the dropped connection
        assert outbox.flush(timeout=10)
        outbox.put([Batch(rid, 1, 3, [Text(rid, "c", [3])])])
        assert outbox.flush(timeout=10)
    finally:
        outbox.stop(timeout=10)

    assert [error for _, _, error in results.writes] == [None, None, None]
    assert _texts(client, rid) == ["a", "b", "c"]
    assert own not in _writers(client)


class ReplyDroppingProxy:
    """A TCP relay to Redis that loses the reply to one write after Redis ran it.

    What a connection cut between the server's work and the reply looks like
    to a client (a socket timeout, a broken network): the write reaches
    Redis, and the writer, seeing no answer, sends it again.
    """

    def __init__(self, redis_port: int, drop_reply_to: bytes) -> None:
        self.port = free_port()
        self._redis_port = redis_port
        self._marker = drop_reply_to
        self.dropped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._redis_port))
            armed = threading.Event()
            threading.Thread(target=self._relay, args=(client, upstream, armed, True)).start()
            threading.Thread(target=self._relay, args=(upstream, client, armed, False)).start()

    def _relay(
        self, source: socket.socket, sink: socket.socket, armed: threading.Event, up: bool
    ) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if up and self._marker in data and not self.dropped.is_set():
                    armed.set()
                elif not up and armed.is_set():
                    self.dropped.set()
                    break  # Redis answered; the writer never hears it
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


def test_a_write_sent_again_after_its_reply_was_lost_adds_no_event_twice(
    redis_url: str, client: redis.Redis
) -> None:
    rid = _request(client, 1)
    proxy = ReplyDroppingProxy(client.connection_pool.connection_kwargs["port"], b'"b"')
    relayed = connect(f"redis://127.0.0.1:{proxy.port}/0")
    results = Results()
    outbox = Outbox(EventPublisher(relayed, DEFAULT_MODEL), results)
    outbox.start()
    try:
        for seq, text in enumerate("abc", 1):
            outbox.put([Batch(rid, 1, seq, [Text(rid, text, [seq])])])
            assert outbox.flush(timeout=10)
    finally:
        outbox.stop(timeout=10)
        proxy.close()
        relayed.close()

    assert proxy.dropped.is_set()
    assert [error for _, _, error in results.writes] == [None, None, None]
    assert _texts(client, rid) == ["a", "b", "c"]
