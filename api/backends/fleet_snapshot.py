"""What a model's workers and its in-flight set said at one instant (``api.backends.fleet``
reads it; admission, placement and metrics decide from it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.wire import WorkerLoad


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """What the workers of one model and the in-flight set said at ``taken_at``."""

    workers: tuple[WorkerLoad, ...] = ()
    outstanding: int = 0  # accepted and not finished: queued + running
    queued: int = 0  # messages in the model's queue lists, not taken by a worker yet
    taken_at: float = 0.0  # monotonic; 0 = never read

    @property
    def in_flight(self) -> int:
        """Outstanding requests a worker has taken: running, waiting or reserved.

        Not the workers' heartbeats (``running + waiting``): those count only
        what an engine holds, so they miss the jobs a worker has reserved
        and not yet started and, above all, those of a worker that died,
        which wait in no list and no heartbeat until a live worker's heartbeat
        hands them back, and are the work a replacement worker is needed for.
        Not below 0: a list can still hold the message of a request cancelled
        before any worker took it (the first worker to pop it drops it).
        """
        return max(self.outstanding - self.queued, 0)

    @property
    def live(self) -> tuple[WorkerLoad, ...]:
        """Workers that take new jobs (a draining worker only finishes what it has)."""
        return tuple(worker for worker in self.workers if not worker.draining)

    def desired_workers(self, default_capacity: int) -> int:
        """``ceil((queued + in flight) / per-worker capacity)``: the autoscaling signal.

        Not the Celery list length alone: a worker reserves (prefetches) jobs
        up to its free slots, and those leave the list while still waiting
        for the GPU, so a short list can hide a saturated fleet and an empty
        list would scale a busy fleet to zero. The per-worker capacity is the
        smallest any heartbeat reports.
        """
        capacities = [worker.capacity for worker in self.workers if worker.capacity > 0]
        per_worker = min(capacities) if capacities else default_capacity
        return math.ceil((self.queued + self.in_flight) / max(per_worker, 1))
