"""Keeping running jobs' messages out of the broker's redelivery sweep.

With kombu's Redis transport a delivered, unacked message sits in the hash
``unacked`` and in the sorted set ``unacked_index``, scored with its delivery
time. Every consuming worker periodically moves back to its queue each
message whose score is older than the visibility timeout: that is how the
job of a worker killed with ``kill -9`` is redelivered, and also how a live
worker's long generation would be redelivered to a second worker.

So the worker refreshes the score of the messages it is running, once per
heartbeat (``ZADD XX``: never re-adds a message that was acked or restored
meanwhile). The visibility timeout then only bounds how long a dead worker's
jobs wait, not how long a generation may run; a job whose worker stops
refreshing is redelivered ``visibility_timeout`` (plus one sweep interval)
after its last refresh. Scores are Redis's own clock (``TIME``), as in the
take script and the sweep (``workers.transport``), so the workers' clocks
need not agree.

The refresh rides on the heartbeat, every ``REFRESH_INTERVAL_S``; a visibility
timeout shorter than a few of those would redeliver a live worker's job after
one slow or failed beat, so the worker refuses one (``check_visibility_timeout``).
"""

from __future__ import annotations

import threading
from typing import Any

import redis

UNACKED_INDEX_KEY = "unacked_index"  # kombu's default, passed to it explicitly
UNACKED_MUTEX_KEY = "unacked_mutex"  # the sweep's lock (kombu's default name)
REFRESH_INTERVAL_S = 1.0  # the worker's heartbeat interval, which refreshes running messages
MIN_REFRESHES_PER_TIMEOUT = 3  # refreshes a live worker may miss before its job looks dead

RENEW_SCRIPT = """
-- KEYS: the unacked index. ARGV: delivery tags. Scores them with Redis's clock,
-- the one the sweep compares with; never re-adds a tag acked or restored meanwhile.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
for _, tag in ipairs(ARGV) do
  redis.call('ZADD', KEYS[1], 'XX', now, tag)
end
return #ARGV
"""


def check_visibility_timeout(
    timeout_s: float, refresh_interval_s: float = REFRESH_INTERVAL_S
) -> None:
    """Refuse a visibility timeout that a live worker's refreshes would not reliably beat."""
    minimum_s = MIN_REFRESHES_PER_TIMEOUT * refresh_interval_s
    if not timeout_s >= minimum_s:  # also refuses NaN
        raise ValueError(
            f"visibility timeout {timeout_s:g}s is too short: running jobs are refreshed "
            f"every {refresh_interval_s:g}s, so it must be at least {minimum_s:g}s "
            f"({MIN_REFRESHES_PER_TIMEOUT} refreshes) or live workers' jobs get redelivered"
        )


class DeliveryTracker:
    """Delivery tags of the messages this worker runs, keyed by task id."""

    def __init__(self, index_key: str = UNACKED_INDEX_KEY) -> None:
        self._index_key = index_key
        self._tags: dict[str, str] = {}
        self._lock = threading.Lock()

    def received(self, task_id: str, delivery_tag: str | None) -> None:
        if delivery_tag is None:
            return
        with self._lock:
            self._tags[task_id] = delivery_tag

    def forget(self, task_id: str) -> None:
        with self._lock:
            self._tags.pop(task_id, None)

    def renew(self, pipe: redis.client.Pipeline) -> None:
        """Queue on ``pipe`` the refresh of every tracked message's score, by Redis's clock."""
        with self._lock:
            tags = list(self._tags.values())
        if tags:
            pipe.eval(RENEW_SCRIPT, 1, self._index_key, *tags)

    def connect(self) -> None:
        """Follow Celery's signals: a task is tracked from receipt until it has run."""
        from celery import signals

        signals.task_received.connect(self._on_received, weak=False)
        signals.task_postrun.connect(self._on_postrun, weak=False)
        signals.task_revoked.connect(self._on_revoked, weak=False)

    def disconnect(self) -> None:
        from celery import signals

        signals.task_received.disconnect(self._on_received)
        signals.task_postrun.disconnect(self._on_postrun)
        signals.task_revoked.disconnect(self._on_revoked)

    def _on_received(self, request: Any = None, **_: Any) -> None:
        message = getattr(request, "message", None)
        self.received(request.id, getattr(message, "delivery_tag", None))

    def _on_postrun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id is not None:
            self.forget(task_id)

    def _on_revoked(self, request: Any = None, **_: Any) -> None:
        if request is not None:
            self.forget(request.id)
