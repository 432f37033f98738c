"""Jobs the take script started as it took them, until their task threads run.

A job's start (its next attempt, its cancel flag, what earlier attempts
streamed, whether its API process lives) used to be a transaction of its
own, sent from the task thread once Celery had handed it the job: one more
round trip between the job's message reaching the worker and the engine
(0.6-0.9 ms p50 at one stream on two cores, 1.2 ms at 32). The take script
(``workers.transport``) now does the same reads and the same increment in
the atomic step that takes the message, for every message that names its
job in its headers (``shared.task_message.JOB_HEADER``). The transport
leaves each reply here before it delivers the message; the task picks it
up by request id, and starts a job it finds nothing for (a message from a
producer that did not name the job) the old way.

A reply nobody picks up (its message never reached a task: the worker shut
down first) only means that attempt was never used; the next delivery takes
another. The oldest replies are let go past ``LIMIT``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

TRANSPORT_OPTION = "sluice_taken"
LIMIT = 4096  # far more than a worker's slots: only replies nobody picked up are let go


class TakenStart(NamedTuple):
    """The take script's replies for one job, as ``workers.task.begin_all`` reads them."""

    attempt: Any
    cancelled: Any
    entries: Any  # [(entry id, {field: value})]
    origin_alive: Any


class TakenStarts:
    """Starts by request id, written by the broker consumer, read by task threads."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._starts: OrderedDict[str, TakenStart] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def put(self, request_id: str, start: TakenStart) -> None:
        """Keep ``start``; a newer take of the same request replaces an older one."""
        with self._lock:
            self._starts.pop(request_id, None)
            self._starts[request_id] = start
            while len(self._starts) > self._limit:
                self._starts.popitem(last=False)

    def pop(self, request_id: str) -> TakenStart | None:
        with self._lock:
            return self._starts.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._starts)
