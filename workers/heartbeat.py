"""Heartbeats: each worker's entry in its model's registry, and failover for the dead ones.

Every ``interval_s`` a worker renews its entry in the model's registry
(``keys.workers``: expiry ``HEARTBEAT_TTL_S`` past Redis's clock) and its
load report (``keys.worker_loads``), which the API reads for backpressure,
``/metrics`` and readiness. A clean exit removes both and hands back what
the worker still holds.

The same script (``scripts/beat.lua``) puts every job of the model's
workers whose entries expired back at the head of its queue, and removes
them: a killed worker's job is taken by a live worker within about one TTL
and one interval, and resumes from its stream under a new attempt. A worker
reclaims only once its own entry has stayed renewed for a whole TTL on
Redis's clock (``keys.workers_alive_since``): after Redis stalled or was
away every entry has expired, and each live worker must first renew its
own. A live worker taken for dead all the same loses only work: its
attempts are fenced out (``workers.publisher``) as the new ones start.
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
from workers.broker.scripts import BEAT, LEAVE
from workers.host import HostSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    model: str


class Heartbeat:
    """A thread that beats every ``interval_s`` seconds; see the module docstring."""

    def __init__(
        self,
        client: redis.Redis,
        identity: WorkerIdentity,
        snapshot: Callable[[], HostSnapshot],
        draining: Callable[[], bool],
        interval_s: float = keys.HEARTBEAT_INTERVAL_S,
        ttl_s: float = keys.HEARTBEAT_TTL_S,
    ) -> None:
        self._client = client
        self._identity = identity
        self._snapshot = snapshot
        self._draining = draining
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        model = identity.model
        self._keys = [
            keys.workers(model),
            keys.worker_loads(model),
            keys.workers_alive_since(model),
        ]
        self._last: tuple[float, int] | None = None  # (time, generated tokens) of the last beat
        self.reclaimed = 0  # jobs of dead workers this worker put back on their queues
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-heartbeat", daemon=True)

    def start(self) -> None:
        """Hand back what an earlier process of this worker id held, then beat."""
        self._leave("an earlier process of this worker id")
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating and leave the registry, handing back whatever this worker still holds."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._leave("this worker at exit")

    def _leave(self, holder: str) -> None:
        worker_id = self._identity.worker_id
        try:
            restored = LEAVE(self._client, [*self._keys, keys.taken(worker_id)], [worker_id])
        except redis.RedisError as exc:  # the entry expires; another worker hands them back
            log.warning("could not leave the registry: %s", exc)
            return
        if restored:
            log.warning("handed back %d job(s) that %s held", restored, holder)

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
        """Renew this worker's entry and report; reclaim dead workers' jobs once it may."""
        report = json.dumps(self.report(), separators=(",", ":"))
        args = [self._identity.worker_id, report, self._ttl_s, keys.TAKEN_PREFIX]
        dead, restored = BEAT(self._client, self._keys, args)
        if dead:
            self.reclaimed += restored
            names = ", ".join(_text(worker) for worker in dead)
            log.warning("worker(s) %s died: %d job(s) back on their queues", names, restored)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # a heartbeat that died would let others take this worker for dead
                log.exception("the heartbeat failed")
            self._stopping.wait(self._interval_s)

    def _tokens_per_s(self, now: float, tokens: int) -> float:
        """Generation rate since the previous beat."""
        last, self._last = self._last, (now, tokens)
        if last is None or now <= last[0]:
            return 0.0
        return round((tokens - last[1]) / (now - last[0]), 2)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
