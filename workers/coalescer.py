"""Group commit for threads: calls that arrive while one is in flight share the next.

A burst of jobs reaches a worker as a burst of task threads, each of which
used to make its own Redis round trip to take its job's lease. On two
shared cores those 32 round trips, each waiting for the GIL behind the
engine thread, took 1.5-11 ms each (p50) and up to 28 ms. Here the first
caller runs its call alone; the callers that arrive meanwhile queue up and
the next of them runs all their calls as one batch (one pipeline), and so
on: no thread waits for more than the batch in flight and its own.
Leadership passes from thread to thread, so no thread of its own is needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(eq=False, slots=True)
class _Call(Generic[In, Out]):
    item: In
    result: Out | None = None
    error: BaseException | None = None
    settled: bool = False
    wake: threading.Event = field(default_factory=threading.Event)


class Coalescer(Generic[In, Out]):
    """``coalescer(item)`` runs ``run_batch([..., item, ...])`` and returns item's result.

    ``run_batch`` returns one result per item, in order; if it raises,
    every call of that batch raises the same exception.
    """

    def __init__(self, run_batch: Callable[[Sequence[In]], Sequence[Out]]) -> None:
        self._run_batch = run_batch
        self._lock = threading.Lock()
        self._waiting: list[_Call[In, Out]] = []
        self._busy = False  # a batch is being run (or a successor has been named)

    def __call__(self, item: In) -> Out:
        call: _Call[In, Out] = _Call(item)
        with self._lock:
            self._waiting.append(call)
            leading, self._busy = not self._busy, True
        if not leading:
            call.wake.wait()  # set once settled, or once named to run the next batch
        if not call.settled:
            self._lead()
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _lead(self) -> None:
        """Run every waiting call as one batch, then hand over to the next waiting call."""
        with self._lock:
            batch, self._waiting = self._waiting, []
        try:
            results = self._run_batch([call.item for call in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except BaseException as exc:
            for call in batch:
                call.error = exc
        else:
            for call, result in zip(batch, results, strict=True):
                call.result = result
        with self._lock:
            successor = self._waiting[0] if self._waiting else None
            self._busy = successor is not None
        for call in batch:
            call.settled = True
            call.wake.set()
        if successor is not None:
            successor.wake.set()
