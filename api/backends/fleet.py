"""The fleet watcher: the model's live workers, outstanding work and queue, once a second.

``health``, ``models``, ``/metrics`` and admission's wait for a live worker
read the watcher's snapshot, so none of them costs a Redis round trip per
call. The bound on outstanding work is checked again, exactly, by the
submission's script (``api.backends.request_queue``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.backends.fleet_snapshot import FleetSnapshot
from api.backends.placement import KINDS
from shared import keys
from shared.engine_metrics import EngineLoad, engine_families
from shared.task_message import queue_lists
from shared.wire import WorkerLoad

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # the snapshot is at most this stale
STALE_S = 5.0  # no successful read for this long: Redis is unreachable, not ready


class FleetWatcher:
    """Keeps ``snapshot`` fresh for one model; see the module docstring."""

    def __init__(self, redis: Redis, model: str) -> None:
        self._redis = redis
        self._model = model
        self._queue_lists = queue_lists(keys.queue_name(model))
        self.snapshot = FleetSnapshot()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="sluice-fleet-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=1.0)

    @property
    def stale(self) -> bool:
        return time.monotonic() - self.snapshot.taken_at > STALE_S

    async def _watch(self) -> None:
        while True:
            try:
                self.snapshot = await self.read()
            except (RedisError, OSError) as exc:
                log.debug("reading the fleet failed: %s", exc)
            except Exception:  # a watcher that died would leave this process unready for good
                log.exception("the fleet watcher failed")
            await asyncio.sleep(REFRESH_S)

    async def read(self) -> FleetSnapshot:
        """The live workers' loads, the in-flight count (expired entries pruned) and the
        queue length, in one transaction (``MULTI``/``EXEC``, one round trip).

        A worker is live while its registry entry's expiry is ahead of Redis's
        own clock (``TIME``, read in the same transaction), the clock the
        workers score their entries with. The in-flight count and the queue
        length are of the same instant: a job joins the set and its list in
        one script, and a worker's take script moves it from the list
        atomically, so ``queued <= outstanding`` holds in what is read (but
        for the exception ``FleetSnapshot.in_flight`` names). The workers' own
        queues are counted by their wake lists (one token per job), for the
        workers the previous read found.
        """
        inflight = keys.inflight(self._model)
        own = [keys.own_queue(self._model, w.worker_id) for w in self.snapshot.workers]
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.time()
            pipe.zrange(keys.workers(self._model), 0, -1, withscores=True)
            pipe.hgetall(keys.worker_loads(self._model))
            pipe.zremrangebyscore(inflight, "-inf", time.time())
            pipe.zcard(inflight)
            for name in [*self._queue_lists, *map(keys.queue_wake, own)]:
                pipe.llen(name)
            clock, registry, loads, _, outstanding, *lengths = await pipe.execute()
        now = clock[0] + clock[1] / 1e6
        live = [loads.get(worker) for worker, expiry in registry if expiry > now]
        return FleetSnapshot(
            tuple(_worker_loads(live)), outstanding, sum(lengths), time.monotonic()
        )


def _worker_loads(values: list[str | None]) -> Iterator[WorkerLoad]:
    for value in values:
        if value is None:  # registered, its first report not written yet
            continue
        try:
            yield WorkerLoad.from_json(json.loads(value))
        except (ValueError, TypeError) as exc:
            log.warning("ignoring a malformed worker report: %s", exc)


FLEET_GAUGES = {
    "sluice_requests_outstanding": "Queued + in-flight requests (the model's in-flight set).",
    "sluice_requests_queued": "Jobs in the model's queue lists, not yet taken by a worker.",
    "sluice_requests_in_flight": "Outstanding requests a worker has taken (not queued).",
    "sluice_workers_live": "Workers with a live heartbeat, draining ones included.",
    "sluice_workers_draining": "Live workers that are draining (taking no new jobs).",
    "sluice_workers_running_requests": "Sequences in the workers' running batches.",
    "sluice_workers_waiting_requests": "Requests waiting inside the workers' engines.",
    "sluice_kv_blocks_used": "KV cache blocks in use, summed over workers.",
    "sluice_kv_blocks_total": "KV cache blocks, summed over workers.",
    "sluice_cache_summary_blocks": "Block hashes in the workers' cache summaries, summed.",
    "sluice_desired_workers": "ceil((queued + in flight) / per-worker capacity): scale to this.",
}


def fleet_gauges(snapshot: FleetSnapshot, default_capacity: int) -> dict[str, int]:
    """The values of ``FLEET_GAUGES`` for one model's snapshot."""
    workers = snapshot.workers
    return {
        "sluice_requests_outstanding": snapshot.outstanding,
        "sluice_requests_queued": snapshot.queued,
        "sluice_requests_in_flight": snapshot.in_flight,
        "sluice_workers_live": len(workers),
        "sluice_workers_draining": len(workers) - len(snapshot.live),
        "sluice_workers_running_requests": sum(worker.running for worker in workers),
        "sluice_workers_waiting_requests": sum(worker.waiting for worker in workers),
        "sluice_kv_blocks_used": sum(worker.kv_blocks_used for worker in workers),
        "sluice_kv_blocks_total": sum(worker.kv_blocks_total for worker in workers),
        "sluice_cache_summary_blocks": sum(worker.cache_summary_size for worker in workers),
        "sluice_desired_workers": snapshot.desired_workers(default_capacity),
    }


def fleet_load(snapshot: FleetSnapshot) -> EngineLoad:
    """The live workers' engines as one. Every outstanding request not running counts as
    waiting (queued, reserved by a worker, or waiting in its engine), so running + waiting is
    the model's outstanding work, what autoscaling divides by a worker's capacity."""
    workers = snapshot.workers
    running = sum(worker.running for worker in workers)
    return EngineLoad(
        running=running,
        waiting=max(0, snapshot.outstanding - running),
        kv_blocks_used=sum(worker.kv_blocks_used for worker in workers),
        kv_blocks_total=sum(worker.kv_blocks_total for worker in workers),
        preemptions=sum(worker.preemptions for worker in workers),
    )


class FleetCollector(Collector):
    """Per-model gauges for ``/metrics``, read from the fleet snapshot at scrape time, and the
    placements by kind."""

    def __init__(
        self,
        model: str,
        snapshot: Callable[[], FleetSnapshot],
        capacity: int,
        placed: Counter[str] | None = None,
    ) -> None:
        self._model = model
        self._snapshot = snapshot
        self._capacity = capacity
        self._placed = placed if placed is not None else Counter()

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        yield from engine_families(self._model, fleet_load(snapshot))
        for name, value in fleet_gauges(snapshot, self._capacity).items():
            family = GaugeMetricFamily(name, FLEET_GAUGES[name], labels=["model"])
            family.add_metric([self._model], value)
            yield family
        placed = CounterMetricFamily(
            "sluice_placements",
            "Requests by where they were queued: a worker's own queue for its cached prefix "
            "(prefix), for its load over a longer match elsewhere (load), or the shared queue.",
            labels=["model", "placement"],
        )
        for kind in KINDS:
            placed.add_metric([self._model, kind], self._placed[kind])
        yield placed
