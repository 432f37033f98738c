"""The distributed backend: requests go to GPU workers as Celery tasks over Redis.

This process never loads a model (nor torch): it keeps the served model's
tokenizer for preparation, sends each prepared request as a job on the
model's queue, and reads the events workers write to the request's stream
through the process-wide ``EventReader``. Who owns what:

- ``infer`` owns one request: it submits the job (the request joins the
  model's in-flight set), yields events until a ``Finish`` or ``Error``, and
  enforces the deadlines. Closing it before the end publishes a cancellation;
  its cleanup (cancel, leaving the in-flight set) runs as a task of its own,
  so it completes even when the closing task is being cancelled.
- A fleet watcher renews this process's liveness key (``keys.api_process``)
  and reads worker heartbeats, the in-flight set and the length of the
  model's queue about once a second. Every job names this process as its
  origin: once the key has expired (the process died, and its clients'
  connections with it), workers stop its jobs instead of generating for
  nobody. ``health``, ``models``, ``/metrics`` and admission's wait for a
  live worker read the watcher's snapshot, so none of them costs a Redis
  round trip per call. The bound on outstanding
  work is checked again, exactly, by the submission's script
  (``api.backends.job_queue``).

Unseeded sampling requests get a seed here, at submission: a job redelivered
after its worker died then continues the same random draws, which is what
makes a resumed stream indistinguishable from an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from kombu.transport.redis import Channel
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.admission import (
    Admission,
    FleetSnapshot,
    Limits,
    WorkerLoad,
    api_error,
    rate_limited_message,
)
from api.backends.base import Backend, BackendHealth, ServedModel
from api.backends.event_reader import EventReader, Subscription
from api.backends.job_queue import JobQueue, with_seed, withdraw
from shared import keys
from shared.events import Error, Finish, InferenceEvent, Text
from shared.heap import freeze_startup_heap
from shared.registry import ModelSpec
from shared.task_message import TaskMessage, priority_list
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer
from shared.wire import Deadlines, Job, PreparedRequest

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

    from api.settings import Settings

log = logging.getLogger(__name__)

FLEET_REFRESH_S = 1.0  # heartbeats are read at most this stale
FLEET_STALE_S = 5.0  # no successful read for this long: Redis is unreachable, not ready
CLEANUP_TIMEOUT_S = 5.0
MAX_UNSENT_ENDS = 10_000  # kept for when Redis answers again; older ones are let go


class DistributedBackend(Backend):
    """Runs requests on workers through Redis; see the module docstring."""

    def __init__(self, redis_url: str, spec: ModelSpec, settings: Settings) -> None:
        self._spec = spec
        self._model = spec.name
        self._max_model_len = settings.max_model_len
        self._default_capacity = settings.max_num_seqs
        self._limits = Limits(
            queue_timeout_s=settings.queue_timeout_s,
            first_token_timeout_s=settings.first_token_timeout_s,
            total_timeout_s=settings.total_timeout_s,
            max_inflight=settings.max_inflight,
        )
        self._redis = Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2
        )
        self._reader = EventReader(redis_url)
        self._queue = JobQueue(self._redis)
        self._queue_lists = queue_lists(spec.name)
        self._snapshot = FleetSnapshot()
        self._admission = Admission(self._limits, lambda: self._snapshot, self._count_outstanding)
        self._tokenizer: LoadedTokenizer | None = None
        self._served: ServedModel | None = None
        self._load_error: str | None = None
        self._process_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._tasks: set[asyncio.Task[Any]] = set()  # request cleanups in progress
        self._unsent_ends: dict[str, _End] = {}  # request id -> an end Redis did not receive
        self._watcher: asyncio.Task[None] | None = None
        self._collector = FleetCollector(self)

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Load the tokenizer and start the stream reader and the fleet watcher."""
        await self._reader.start()
        try:  # before any job names this process; the watcher renews it from here on
            await self._renew_liveness()
        except (RedisError, OSError) as exc:
            log.warning("could not announce this API process in Redis: %s", exc)
        self._watcher = asyncio.create_task(self._watch_fleet(), name="sluice-fleet-watcher")
        try:
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self._spec.tokenizer)
        except Exception as exc:  # reported by /ready, like a model that fails to load
            log.exception("loading the tokenizer failed")
            self._load_error = f"loading the tokenizer failed: {exc}"
        else:
            freeze_startup_heap()

    async def stop(self) -> None:
        """Stop reading and watching; open requests end with an ``Error``.

        Cleanups in progress get a moment to finish; nothing here waits on
        Redis without a limit (a cancelled call can hang in redis-py).
        """
        await self._reader.stop()
        pending = [*self._tasks, *([self._watcher] if self._watcher else [])]
        if self._watcher is not None:
            self._watcher.cancel()
        if pending:
            await asyncio.wait(pending, timeout=CLEANUP_TIMEOUT_S)
        await self._redis.aclose()

    # --- what the app reads ------------------------------------------------------

    async def admit(self) -> None:
        """Admission for one request, before its preparation (429/503 ``ApiError``)."""
        await self._admission.admit()

    def metrics_collector(self) -> FleetCollector:
        """Per-model queue and worker gauges."""
        return self._collector

    @property
    def snapshot(self) -> FleetSnapshot:
        return self._snapshot

    @property
    def model(self) -> str:
        return self._model

    @property
    def default_capacity(self) -> int:
        return self._default_capacity

    def health(self) -> BackendHealth:
        """Ready once the tokenizer is loaded, Redis answers and the context length is known.

        The counters are the sums over the live workers' heartbeats.
        """
        snapshot = self._snapshot
        workers = snapshot.workers
        detail = self._not_ready_because(snapshot)
        return BackendHealth(
            ready=detail is None,
            detail=detail or f"{len(snapshot.live)} live worker(s)",
            running=sum(worker.running for worker in workers),
            waiting=sum(worker.waiting for worker in workers),
            aborted=sum(worker.aborted for worker in workers),
            steps=sum(worker.steps for worker in workers),
            generated_tokens=sum(worker.generated_tokens for worker in workers),
        )

    def _not_ready_because(self, snapshot: FleetSnapshot) -> str | None:
        if self._load_error is not None:
            return self._load_error
        if self._tokenizer is None:
            return "loading the tokenizer"
        if time.monotonic() - snapshot.taken_at > FLEET_STALE_S or not self._reader.connected:
            return "Redis is unreachable"
        if self._context_length(snapshot) <= 0:
            return "waiting for a worker to report the model's context length"
        return None

    def models(self) -> list[ServedModel]:
        """The served model; its context length is the smallest any live worker allows."""
        if self._tokenizer is None:
            return []
        length = self._context_length(self._snapshot)
        if self._served is None or self._served.context_length != length:
            self._served = ServedModel(self._spec, self._tokenizer, length)
        return [self._served]

    def _context_length(self, snapshot: FleetSnapshot) -> int:
        limits = [self._spec.context_length, self._max_model_len or 0]
        limits += [worker.max_model_len for worker in snapshot.workers]
        positive = [limit for limit in limits if limit > 0]
        return min(positive) if positive else 0

    # --- one request ---------------------------------------------------------------

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        """Submit ``request`` and yield its events; leaving early cancels it on the worker.

        Any end but a ``Finish`` (the client gone, a deadline, Redis lost, an
        error) publishes a cancellation: a worker may still be generating for
        a request this side has given up on, and cancelling a job that has
        already ended costs nothing. A job no event came for yet is also
        withdrawn from its queue, if no worker has taken it.
        """
        request = with_seed(request)
        request_id = request.request_id
        deadlines = self._limits.deadlines(time.time())
        subscription = self._reader.open(request_id, wake=False)  # the submit wakes it
        progress = _Progress()
        queued: TaskMessage | Error | None = None
        last: InferenceEvent | None = None
        try:
            job = Job(request, deadlines, origin=self._process_id)
            queued = await self._submit(job, self._reader.take_wake())
            if isinstance(queued, Error):
                last = queued
                yield last
                return
            while not isinstance(last, Finish | Error):
                last = await self._next_event(subscription, deadlines, progress)
                yield last
        finally:
            self._reader.close(request_id)
            untaken = queued if isinstance(queued, TaskMessage) and not progress.started else None
            self._spawn(self._end(request_id, cancel=not isinstance(last, Finish), untaken=untaken))

    async def _count_outstanding(self) -> int:
        """The model's live in-flight entries, read now; a 503 if Redis is unreachable."""
        try:
            return await self._redis.zcount(keys.inflight(self._model), time.time(), "+inf")
        except (RedisError, OSError) as exc:
            raise api_error("unavailable", f"Redis is unreachable ({exc}); retry later.") from exc

    async def _submit(self, job: Job, wake: str | None) -> TaskMessage | Error:
        """Join the in-flight set and queue the job: its message, or the ``Error`` that ends it."""
        request_id, limits = job.request.request_id, self._limits
        try:
            score = job.deadlines.total or time.time() + limits.total_timeout_s
            queued = await self._queue.put(job, score, limits.max_inflight, wake)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("submitting %s failed: %s", request_id, exc)
            message = "Could not queue the request: Redis is unreachable; retry later."
            return Error(request_id, message, "unavailable")
        if queued is None:
            return Error(request_id, rate_limited_message(limits.max_inflight), "rate_limited")
        return queued

    async def _next_event(
        self, subscription: Subscription, deadlines: Deadlines, progress: _Progress
    ) -> InferenceEvent:
        """The next event, or a timeout ``Error`` once the pending deadline has passed."""
        deadline, kind = progress.pending_deadline(deadlines)
        try:
            async with asyncio.timeout(None if deadline is None else deadline - time.time()):
                event = await subscription.events.get()
        except TimeoutError:
            return Error(subscription.request_id, self._timeout_message(kind), kind)
        progress.saw(event)
        return event

    def _timeout_message(self, kind: str) -> str:
        limits = self._limits
        return {
            "queue_timeout": f"No worker started the request within {limits.queue_timeout_s:g}s; "
            "the model's workers are busy, retry later.",
            "first_token_timeout": "The model produced no token within "
            f"{limits.first_token_timeout_s:g}s.",
            "total_timeout": f"The generation did not finish within {limits.total_timeout_s:g}s.",
        }[kind]

    async def _end(self, request_id: str, *, cancel: bool, untaken: TaskMessage | None) -> None:
        """Leave the in-flight set and, for a request not run to its end, cancel it.

        ``untaken``: the message of a job no worker had started as far as this
        process saw; it is withdrawn from the queue if still there. If Redis
        cannot be reached, the fleet watcher sends it again once Redis
        answers: a worker that kept its job through the outage would
        otherwise generate for nobody until the job's budget runs out.
        """
        end = _End(cancel, untaken, time.monotonic() + self._limits.total_timeout_s + 60)
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                async with self._redis.pipeline(transaction=False) as pipe:
                    self._queue_end(pipe, request_id, end)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("ending %s in Redis failed, to retry: %s", request_id, exc)
            self._unsent_ends[request_id] = end
            if len(self._unsent_ends) > MAX_UNSENT_ENDS:  # a long outage under load
                del self._unsent_ends[next(iter(self._unsent_ends))]  # the oldest

    def _queue_end(self, pipe: Pipeline, request_id: str, end: _End) -> None:
        if end.cancel:
            ttl = math.ceil(self._limits.total_timeout_s) + 60
            pipe.set(keys.cancel_flag(request_id), "1", ex=ttl)
            pipe.publish(keys.CANCEL_CHANNEL, request_id)
            if end.untaken is not None:
                withdraw(pipe, end.untaken)
        pipe.zrem(keys.inflight(self._model), request_id)

    async def _send_unsent_ends(self) -> None:
        """Send the ends that found Redis unreachable; those past any deadline are dropped."""
        now = time.monotonic()
        pending = [(rid, end) for rid, end in self._unsent_ends.items() if end.until > now]
        self._unsent_ends = dict(pending)  # ends failing while this one is sent join it
        if not pending:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, end in pending:
                self._queue_end(pipe, request_id, end)
            await pipe.execute()
        for request_id, _ in pending:  # the bound may have let some go meanwhile
            self._unsent_ends.pop(request_id, None)
        log.info("sent the ends of %d requests once Redis answered again", len(pending))

    # --- the fleet watcher -----------------------------------------------------------

    async def _watch_fleet(self) -> None:
        while True:
            try:
                await self._renew_liveness()
                await self._send_unsent_ends()
                self._snapshot = await self._read_fleet()
            except (RedisError, OSError) as exc:
                log.debug("reading worker heartbeats failed: %s", exc)
            except Exception:  # a watcher that died would leave this process unready for good
                log.exception("the fleet watcher failed")
            await asyncio.sleep(FLEET_REFRESH_S)

    async def _renew_liveness(self) -> None:
        key = keys.api_process(self._process_id)
        await self._redis.set(key, "1", ex=keys.API_PROCESS_TTL_S)

    async def _read_fleet(self) -> FleetSnapshot:
        """The model's live workers' loads, its in-flight count (expired entries pruned) and
        queue length, in one transaction (``MULTI``/``EXEC``, one round trip).

        A worker is live while its registry entry's expiry is ahead of Redis's
        own clock (``TIME``, read in the same transaction), the clock the
        workers score their entries with. The in-flight count and the queue
        length are of the same instant: a job joins the set and its list in
        one script, and a worker's take script moves it from the list
        atomically, so ``queued <= outstanding`` holds in what is read (but
        for the exception ``FleetSnapshot.in_flight`` names).
        """
        inflight = keys.inflight(self._model)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.time()
            pipe.zrange(keys.workers(self._model), 0, -1, withscores=True)
            pipe.hgetall(keys.worker_loads(self._model))
            pipe.zremrangebyscore(inflight, "-inf", time.time())
            pipe.zcard(inflight)
            for name in self._queue_lists:
                pipe.llen(name)
            clock, registry, loads, _, outstanding, *lengths = await pipe.execute()
        now = clock[0] + clock[1] / 1e6
        live = [loads.get(worker) for worker, expiry in registry if expiry > now]
        workers = tuple(_worker_loads(live))
        return FleetSnapshot(workers, outstanding, sum(lengths), time.monotonic())

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _End(NamedTuple):
    """What ending a request in Redis does (``DistributedBackend._end``), kept for a retry."""

    cancel: bool
    untaken: TaskMessage | None
    until: float  # monotonic: past it every deadline has passed and a worker stopped anyway


@dataclasses.dataclass(slots=True)
class _Progress:
    """How far a request got, which decides the deadline that applies next."""

    started: bool = False  # any event: a worker took the job
    first_token: bool = False

    def saw(self, event: InferenceEvent) -> None:
        self.started = True
        self.first_token = self.first_token or (isinstance(event, Text) and bool(event.token_ids))

    def pending_deadline(self, deadlines: Deadlines) -> tuple[float | None, str]:
        """The earliest deadline still to meet, and the error kind when it passes."""
        candidates = [(deadlines.total, "total_timeout")]
        if not self.first_token:
            candidates.append((deadlines.first_token, "first_token_timeout"))
        if not self.started:
            candidates.append((deadlines.queue, "queue_timeout"))
        dated = [(deadline, kind) for deadline, kind in candidates if deadline is not None]
        return min(dated) if dated else (None, "total_timeout")


def queue_lists(model: str) -> list[str]:
    """The Redis lists of ``model``'s queue: kombu keeps one per priority step."""
    queue = keys.queue_name(model)
    return [priority_list(queue, step) for step in Channel.priority_steps]


def _worker_loads(values: list[str | None]) -> Iterator[WorkerLoad]:
    for value in values:
        if value is None:  # registered, its first report not written yet
            continue
        try:
            yield WorkerLoad.from_json(json.loads(value))
        except (ValueError, TypeError) as exc:
            log.warning("ignoring a malformed worker heartbeat: %s", exc)


_FLEET_GAUGES = {
    "sluice_requests_outstanding": "Queued + in-flight requests (the model's in-flight set).",
    "sluice_requests_queued": "Jobs in the model's queue lists, not yet taken by a worker.",
    "sluice_requests_in_flight": "Outstanding requests a worker has taken (not queued).",
    "sluice_workers_live": "Workers with a live heartbeat, draining ones included.",
    "sluice_workers_draining": "Live workers that are draining (taking no new jobs).",
    "sluice_workers_running_requests": "Sequences in the workers' running batches.",
    "sluice_workers_waiting_requests": "Requests waiting inside the workers' engines.",
    "sluice_kv_blocks_used": "KV cache blocks in use, summed over workers.",
    "sluice_kv_blocks_total": "KV cache blocks, summed over workers.",
    "sluice_desired_workers": "ceil((queued + in flight) / per-worker capacity): scale to this.",
}


def fleet_gauges(snapshot: FleetSnapshot, default_capacity: int) -> dict[str, int]:
    """The values of ``_FLEET_GAUGES`` for one model's snapshot."""
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
        "sluice_desired_workers": snapshot.desired_workers(default_capacity),
    }


class FleetCollector(Collector):
    """Per-model gauges for ``/metrics``, read from the fleet snapshot at scrape time."""

    def __init__(self, backend: DistributedBackend) -> None:
        self._backend = backend

    def collect(self) -> Iterator[Metric]:
        backend = self._backend
        values = fleet_gauges(backend.snapshot, backend.default_capacity)
        for name, value in values.items():
            family = GaugeMetricFamily(name, _FLEET_GAUGES[name], labels=["model"])
            family.add_metric([backend.model], value)
            yield family


__all__ = ["DistributedBackend", "FleetCollector", "fleet_gauges", "queue_lists"]
