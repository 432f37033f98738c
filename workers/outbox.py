"""The worker's publishing thread: engine steps never wait for Redis.

Writing a step's events is a round trip (about 1.5 ms for 32 streams on a
busy two-core machine, measured) that the engine thread used to wait for
before its next step, so it added to every inter-token gap. The engine
thread now hands each step's batches here and steps on; this thread writes
them in order. When it falls behind, everything queued goes out in one
write, so it catches up in one round trip however many steps it missed.

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
from collections.abc import Callable, Sequence

import redis

from workers.publisher import Batch, EventPublisher

log = logging.getLogger(__name__)

Attempt = tuple[str, int]  # (request id, attempt)
ResultHandler = Callable[[list[Batch], set[Attempt], redis.RedisError | None], None]
"""Called on this thread after each write: the batches, the attempts fenced out,
and the error that lost the whole write (None when it succeeded)."""


class Outbox:
    """Ordered, coalescing event writes on a thread of their own."""

    def __init__(self, publisher: EventPublisher, on_result: ResultHandler) -> None:
        self._publisher = publisher
        self._on_result = on_result
        self._queued: list[Batch] = []
        self._broken: set[Attempt] = set()
        self._writing = False
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sluice-outbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, batches: Sequence[Batch]) -> None:
        with self._wake:
            self._queued.extend(batches)
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

    def _run(self) -> None:
        while (batches := self._take()) is not None:
            try:
                self._write(batches)
            except Exception:  # the thread must outlive any one write
                log.exception("writing events failed")
            finally:
                with self._wake:
                    self._writing = False
                    self._wake.notify_all()

    def _take(self) -> list[Batch] | None:
        with self._wake:
            while not self._queued and not self._stopping:
                self._wake.wait()
            if not self._queued:
                return None
            batches, self._queued = self._queued, []
            self._writing = True
        return _merged(batches)

    def _write(self, batches: list[Batch]) -> None:
        batches = [b for b in batches if (b.request_id, b.attempt) not in self._broken]
        if not batches:
            return
        try:
            fenced = self._publisher.publish(batches)
        except redis.RedisError as exc:
            self._broken.update((b.request_id, b.attempt) for b in batches)
            self._on_result(batches, set(), exc)
            return
        self._on_result(batches, fenced, None)


def _merged(batches: list[Batch]) -> list[Batch]:
    """One batch per attempt, its events in the order the steps produced them."""
    merged: dict[Attempt, Batch] = {}
    for batch in batches:
        key = (batch.request_id, batch.attempt)
        if key in merged:
            merged[key].events.extend(batch.events)
        else:
            merged[key] = Batch(batch.request_id, batch.attempt, list(batch.events))
    return list(merged.values())
