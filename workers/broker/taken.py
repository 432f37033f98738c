"""Jobs the take script started as it took them, until their task threads pick them up.

It exists because of Celery's thread-per-job model: the broker consumer's
thread takes a job, a thread of Celery's pool runs it, and Celery hands
that thread the message alone.

The take script (``workers.broker.transport``) takes each job's next
attempt and reads its cancel flag, what earlier attempts streamed and
whether its API process lives, in the atomic step that takes its message.
The transport leaves each reply here, by request id, before it delivers the
message; the task pops it. A reply nobody picks up (its message never
reached a task: the worker shut down first) only means that attempt was
never used; the next delivery takes another. The oldest replies are let go
past ``LIMIT``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

LIMIT = 4096  # far more than a worker's slots: only replies nobody picked up are let go


class TakenStart(NamedTuple):
    """The take script's replies for one job, each a value or the error Redis gave for it, and
    the delivery tag its message is recorded under."""

    attempt: Any
    cancelled: Any
    entries: Any  # [(entry id, {field: value})]
    origin_alive: Any
    delivery_tag: str  # its message's taken record (``keys.taken``)


class TakenStarts:
    """Starts by request id, written by the broker consumer, read by task threads."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._starts: OrderedDict[str, TakenStart | Exception] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def put(self, request_id: str, start: TakenStart | Exception) -> None:
        """Keep ``start`` (or why its replies could not be read); a newer take replaces it."""
        with self._lock:
            self._starts.pop(request_id, None)
            self._starts[request_id] = start
            while len(self._starts) > self._limit:
                self._starts.popitem(last=False)

    def pop(self, request_id: str) -> TakenStart | Exception | None:
        with self._lock:
            return self._starts.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._starts)
