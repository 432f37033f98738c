"""Heartbeats: each worker's load, in a key that vanishes when the worker does.

The API reads ``heartbeat(model, *)`` for backpressure, ``/metrics`` and
routing, and autoscalers for capacity. The key is rewritten every
``interval_s`` with a TTL of ``HEARTBEAT_TTL_S``, so a worker that died (or
lost Redis) drops out of the picture within seconds; a clean exit deletes it
at once. Each beat also refreshes the visibility of the messages being run
(see ``workers.visibility``), in the same round trip.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from workers.host import HostSnapshot
from workers.visibility import DeliveryTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    model: str


class Heartbeat:
    """A thread that writes this worker's report every ``interval_s`` seconds."""

    def __init__(
        self,
        client: redis.Redis,
        identity: WorkerIdentity,
        snapshot: Callable[[], HostSnapshot],
        draining: Callable[[], bool],
        deliveries: DeliveryTracker | None = None,
        interval_s: float = 1.0,
        ttl_s: int = keys.HEARTBEAT_TTL_S,
    ) -> None:
        self._client = client
        self._identity = identity
        self._snapshot = snapshot
        self._draining = draining
        self._deliveries = deliveries
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        self._key = keys.heartbeat(identity.model, identity.worker_id)
        self._last: tuple[float, int] | None = None  # (time, generated tokens) of the last beat
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating and delete the key, so the worker is gone from the API's view now."""
        self._stopping.set()
        self._thread.join(timeout)
        try:
            self._client.delete(self._key)
        except redis.RedisError as exc:  # the key expires on its own
            log.warning("could not delete heartbeat %s: %s", self._key, exc)

    def report(self) -> dict[str, Any]:
        """The JSON body of one beat."""
        snapshot = self._snapshot()
        now = time.time()
        return {
            "worker_id": self._identity.worker_id,
            "model": self._identity.model,
            "running": snapshot.running,
            "waiting": snapshot.waiting,
            "kv_blocks_used": snapshot.kv_blocks_used,
            "kv_blocks_total": snapshot.kv_blocks_total,
            "tokens_per_s": self._tokens_per_s(now, snapshot.generated_tokens),
            "capacity": snapshot.capacity,
            "max_model_len": snapshot.max_model_len,
            "steps": snapshot.steps,
            "generated_tokens": snapshot.generated_tokens,
            "aborted": snapshot.aborted,
            "draining": self._draining(),
            "ts": now,
        }

    def beat(self) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._key, json.dumps(self.report(), separators=(",", ":")), ex=self._ttl_s)
        if self._deliveries is not None:
            self._deliveries.renew(pipe)
        pipe.execute()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self._stopping.wait(self._interval_s)

    def _tokens_per_s(self, now: float, tokens: int) -> float:
        """Generation rate since the previous beat."""
        last, self._last = self._last, (now, tokens)
        if last is None or now <= last[0]:
            return 0.0
        return round((tokens - last[1]) / (now - last[0]), 2)
