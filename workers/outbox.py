"""The worker's event writes: engine steps never wait for Redis.

Writing a step's events is a round trip that the engine thread must not
wait for before its next step, or it would add to every inter-token gap.
One write is in flight at a time, and the engine thread never waits for a
reply:

- When no write is in flight, ``put`` sends the step's write itself, on the
  engine thread, and this module's thread reads the reply. A write handed
  to the thread would wait for the core and the GIL that the engine thread
  holds between steps (the README's benchmark section has the figures).
- While one is in flight, ``put`` queues the step's batches, and the thread
  writes everything queued in one write once the reply is in, so it catches
  up in one round trip however many steps it missed.
- The thread also runs what must follow the writes put before it
  (``call_soon``): the host resolves every run there, so a run's task never
  hears of its end before the events put before it are written.
- The thread also writes whatever the engine thread should not wait for:
  the first write, and the first after a failure or a pause of a few
  seconds, which may have to reconnect (seconds, when Redis is away), and a
  write whose send failed on a dead connection (it was not received, so it
  is sent again on a new one).

A failed write must not leave a hole in a stream: the attempts whose events
it carried are "broken" here, and nothing later of theirs is written. (The
host stops those runs and requeues their jobs; the next attempt reads the
stream as it is.) Whatever an attempt wrote before the next attempt takes
the request's lease is that attempt's history; whatever it writes after is
fenced out by the script, so the delay between step and write changes no
outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis

from workers.publisher import Attempt, Batch, EventPublisher

log = logging.getLogger(__name__)

FRESH_S = 5.0
"""How long after a successful write the engine thread may send the next one.

A connection idle for longer may have been dropped on the way; the thread's
write checks it (and reconnects) off the engine thread."""

ResultHandler = Callable[[list[Batch], set[Attempt], redis.RedisError | None], None]
"""Called on the outbox's thread after each write: the batches, the attempts
fenced out, and the error that lost the whole write (None when it succeeded)."""


class Outbox:
    """Ordered, coalescing event writes, one in flight; see the module docstring."""

    def __init__(self, publisher: EventPublisher, on_result: ResultHandler) -> None:
        self._publisher = publisher
        self._on_result = on_result
        self._connection = publisher.connection()
        self._fresh_until = 0.0  # monotonic; until then ``put`` may send on the connection
        self._queued: list[Batch] = []
        self._handed: tuple[list[Batch], bool] | None = None  # from ``put``: (write, sent)
        self._broken: set[Attempt] = set()
        self._calls: list[Callable[[], None]] = []  # to run once the writes before them end
        self._writing = False  # a write is in flight: the connection is its writer's
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sluice-outbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, batches: Sequence[Batch]) -> None:
        """Write ``batches`` now if nothing is in flight, else with the next write."""
        with self._wake:
            self._queued.extend(batches)
            fresh = time.monotonic() < self._fresh_until
            sending = fresh and not self._writing and self._take_queued()
            if not sending:  # the thread writes them; a send made here wakes it once handed
                self._wake.notify_all()
        if sending:
            self._send_here(sending)

    def call_soon(self, call: Callable[[], None]) -> None:
        """Run ``call`` on this module's thread, after every write put before it has ended.

        On that thread itself, ``call`` runs at once (its writes have ended).
        """
        if threading.current_thread() is self._thread:
            call()
            return
        with self._wake:
            self._calls.append(call)
            self._wake.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything put so far is written (or failed); False on timeout."""
        with self._wake:
            return self._wake.wait_for(
                lambda: not self._queued and not self._writing, timeout=timeout
            )

    def stop(self, timeout: float | None = None) -> None:
        """Write what is queued, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._connection.disconnect()

    def _send_here(self, batches: list[Batch]) -> None:
        """Send on the caller's thread; the reply, or a failed send, is the thread's."""
        try:
            self._publisher.send(self._connection, batches, check_health=False)
            sent = True
        except redis.RedisError:  # not received: the thread sends it on a new connection
            self._connection.disconnect()
            sent = False
        with self._wake:
            if not sent:
                self._fresh_until = 0.0
            self._handed = (batches, sent)
            self._wake.notify_all()

    def _run(self) -> None:
        while (write := self._next()) is not None:
            batches, sent, calls = write
            if batches:
                self._write_and_report(batches, sent)
            for call in calls:
                try:
                    call()
                except Exception:  # the thread must outlive any one call
                    log.exception("a call after the writes failed")

    def _write_and_report(self, batches: list[Batch], sent: bool) -> None:
        try:
            fenced = self._write(batches, sent)
        except redis.RedisError as exc:
            self._finished(batches, set(), exc)
        except Exception:  # the thread must outlive any one write
            log.exception("writing events failed")
            self._finished(batches, set(), redis.RedisError("the write failed"))
        else:
            self._finished(batches, fenced, None)

    def _write(self, batches: list[Batch], sent: bool) -> set[Attempt]:
        """Send (unless ``put`` did) and read the reply; the fenced attempts.

        A write whose connection drops is sent again on a new one, under the
        client's retry policy, as redis-py's own calls are: after a Redis
        restart the write is then fenced out (the lease is gone) rather than
        failed, and its run is dropped instead of being queued again to
        generate for no one. A write sent again may already have run (only
        its reply was lost), so it goes as ``repeated``: the script then
        skips the events the streams already hold.
        """
        connection = self._connection
        tries = 0
        if sent:
            try:
                return self._publisher.receive(connection, batches)
            except (redis.ConnectionError, redis.TimeoutError):
                connection.disconnect()  # sent again below
                tries = 1

        def send_and_receive() -> set[Attempt]:
            nonlocal tries
            repeated, tries = tries > 0, tries + 1  # a lost reply may follow a write that ran
            self._publisher.send(connection, batches, repeated=repeated)
            return self._publisher.receive(connection, batches)

        return connection.retry.call_with_retry(
            send_and_receive, lambda _error: connection.disconnect()
        )

    def _next(self) -> tuple[list[Batch], bool, list[Callable[[], None]]] | None:
        """The next write, whether it was sent already, and the calls to run after it.

        The calls are those queued before the write was taken: every write
        put before them is in it or ended already. None once stopped and done.
        """
        with self._wake:
            while True:
                if self._handed is not None:
                    (batches, sent), self._handed = self._handed, None
                    return batches, sent, self._take_calls()
                if not self._writing and (batches := self._take_queued()):
                    return batches, False, self._take_calls()
                if self._calls and not self._writing and not self._queued:
                    return [], False, self._take_calls()
                if self._stopping and not self._writing and not self._queued:
                    return None
                self._wake.wait()

    def _take_calls(self) -> list[Callable[[], None]]:
        calls, self._calls = self._calls, []
        return calls

    def _take_queued(self) -> list[Batch]:
        """Everything queued and not broken, merged; the caller becomes the writer. Lock held."""
        broken = self._broken
        batches = [b for b in _merged(self._queued) if (b.request_id, b.attempt) not in broken]
        self._queued = []
        self._writing = bool(batches)
        return batches

    def _finished(
        self, batches: list[Batch], fenced: set[Attempt], error: redis.RedisError | None
    ) -> None:
        """End the write in flight, then report it.

        A failed write breaks its attempts before the next write can be sent.
        """
        if error is not None:
            self._connection.disconnect()
        with self._wake:
            if error is None:
                self._fresh_until = time.monotonic() + FRESH_S
            else:
                self._broken.update((b.request_id, b.attempt) for b in batches)
                self._fresh_until = 0.0
            self._writing = False
            self._wake.notify_all()
        self._on_result(batches, fenced, error)


def _merged(batches: list[Batch]) -> list[Batch]:
    """One batch per attempt, its events in the order the steps produced them."""
    merged: dict[Attempt, Batch] = {}
    for batch in batches:
        key = (batch.request_id, batch.attempt)
        if key in merged:
            merged[key].events.extend(batch.events)
        else:
            merged[key] = Batch(batch.request_id, batch.attempt, batch.seq, list(batch.events))
    return list(merged.values())
