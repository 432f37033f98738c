"""Whether this worker takes more jobs now: not while its engine waits for free KV blocks.

Celery's prefetch bounds the jobs a worker holds by its task slots, which are
the engine's sequence slots. A worker whose KV cache is full would still take
jobs up to that bound, only for them to wait in its engine while another
worker, with blocks to spare, could have started them. So the engine thread
closes the intake after a step that preempted a sequence or left one waiting
for blocks, and opens it after a step that did neither; the broker transport
(``workers.broker.transport``) offers no credit while it is closed. Opening wakes
the consumer's event loop, which would otherwise not poll the queue again
until its next timer.
"""

from __future__ import annotations

from collections.abc import Callable


class Intake:
    """An open/closed flag the engine thread sets and the consumer's loop reads."""

    def __init__(self) -> None:
        self._open = True
        self._wake: Callable[[], None] | None = None
        self.closings = 0  # times it closed: the KV cache turned jobs away

    @property
    def open(self) -> bool:
        return self._open

    def attach(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (from the engine thread) whenever the intake opens."""
        self._wake = wake

    def set(self, open_: bool) -> None:
        if open_ == self._open:
            return
        self._open = open_
        if not open_:
            self.closings += 1
        elif self._wake is not None:
            self._wake()
