"""Heartbeats: each worker's entry in its model's registry, and failover for the dead ones.

Every ``interval_s`` a worker renews its entry in the model's registry
(``keys.workers``: expiry ``HEARTBEAT_TTL_S`` past Redis's clock) and its
load report (``keys.worker_loads``), which the API reads for backpressure,
``/metrics`` and readiness. A clean exit removes both and hands back what
the worker still holds.

The same script (``broker/scripts/beat.lua``) hands back the jobs of the worker's
own queue (``keys.own_queue``) whose hand-back time has passed, or all of
them once the worker drains, renews the worker's cache summary
(``workers.cache_summary``; a summary Redis lost is written again whole),
and puts every job of the model's workers whose entries expired, their own
queues' included, back at the head of the model's shared queue, and removes
them: a killed worker's job is taken by a live worker within about one TTL
and one interval, and resumes from its stream under a new attempt. A worker
reclaims only once its own entry has stayed renewed for a whole TTL on
Redis's clock (``keys.workers_alive_since``): after Redis stalled or was
away every entry has expired, and each live worker must first renew its
own. A live worker taken for dead all the same loses only work: its
attempts are fenced out (``workers.publisher``) as the new ones start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from shared import keys
from shared.task_message import list_suffixes
from shared.wire import WorkerLoad
from workers.broker.scripts import BEAT, LEAVE
from workers.broker.transport import BINDING_PREFIXES
from workers.cache_summary import SUMMARY_TTL_S, CacheSummary
from workers.host import HostSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    model: str

    @property
    def shared_queue(self) -> str:
        return keys.queue_name(self.model)

    @property
    def own_queue(self) -> str:
        return keys.own_queue(self.model, self.worker_id)


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
        summary: CacheSummary | None = None,
    ) -> None:
        self._client = client
        self._beat = BEAT.bind(client)
        self._identity = identity
        self._snapshot = snapshot
        self._draining = draining
        self._summary = summary
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
        self.handed_back = 0  # jobs of its own queue this worker put back on the shared queue
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
        try:
            restored = leave(self._client, self._identity)
        except redis.RedisError as exc:  # the entry expires; another worker hands them back
            log.warning("could not leave the registry: %s", exc)
            return
        if restored:
            log.warning("handed back %d job(s) that %s held", restored, holder)

    def report(self) -> WorkerLoad:
        """What one beat writes."""
        snapshot = self._snapshot()
        now = time.time()
        return WorkerLoad(
            worker_id=self._identity.worker_id,
            model=self._identity.model,
            running=snapshot.running,
            waiting=snapshot.waiting,
            kv_blocks_used=snapshot.kv_blocks_used,
            kv_blocks_total=snapshot.kv_blocks_total,
            tokens_per_s=self._tokens_per_s(now, snapshot.generated_tokens),
            capacity=snapshot.capacity,
            max_model_len=snapshot.max_model_len,
            steps=snapshot.steps,
            generated_tokens=snapshot.generated_tokens,
            aborted=snapshot.aborted,
            preemptions=snapshot.preemptions,
            draining=self._draining(),
            block_size=snapshot.block_size,
            intake_open=snapshot.intake_open,
            cache_summary_size=self._summary.size if self._summary is not None else 0,
            ts=now,
        )

    def beat(self) -> None:
        """Renew this worker's entry, report and summary, hand back its overdue own jobs, and
        reclaim dead workers' jobs once it may."""
        identity = self._identity
        report = self.report()
        args = [identity.worker_id, report.to_json(), self._ttl_s]
        args += [keys.TAKEN_PREFIX, identity.shared_queue, keys.own_queue(identity.model, "")]
        args += [keys.queue_wake(""), keys.CACHE_SUMMARY_PREFIX, SUMMARY_TTL_S]
        args += [int(report.draining), *BINDING_PREFIXES, *list_suffixes()]
        dead, restored, handed, summary_kept = self._beat(keys=self._keys, args=args)
        if handed:
            self.handed_back += handed
            log.info("handed back %d job(s) of this worker's own queue", handed)
        if not summary_kept and self._summary is not None and self._summary.size:
            self._summary.rewrite()
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


def leave(client: redis.Redis, identity: WorkerIdentity) -> int:
    """Take ``identity`` out of its model's registry, handing back its taken records and own
    queue to the head of the shared queue and deleting its cache summary; how many it held.
    """
    worker_id, model = identity.worker_id, identity.model
    script_keys = [keys.workers(model), keys.worker_loads(model), keys.workers_alive_since(model)]
    script_keys += [keys.taken(worker_id), keys.cache_summary(worker_id)]
    queues = [identity.shared_queue, identity.own_queue, keys.queue_wake("")]
    args = [worker_id, *queues, *BINDING_PREFIXES, *list_suffixes()]
    return LEAVE.bind(client)(keys=script_keys, args=args)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
