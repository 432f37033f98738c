"""Everything a worker process runs beside Celery, started and stopped together.

The engine host, the cancel watcher, the cache summary and the heartbeat are
threads of their own that share one Redis client (redis-py pools connections and is
thread-safe). The client retries briefly on connection errors and never
waits on a socket for long, so when Redis goes away a write fails within
seconds (the runs it concerned are stopped and handed back) and the threads
carry on and reconnect once it is back.

When the engine thread dies, the host's watchdog hands its runs back and
calls ``terminate_self``: without it the worker would go on taking jobs only
to hand each back, forever.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from prometheus_client import CollectorRegistry, start_http_server
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from shared import keys
from shared.engine_metrics import EngineLoadCollector
from workers.broker import BrokerLink
from workers.cache_summary import CacheSummary
from workers.cancellation import CancellationWatcher
from workers.heartbeat import Heartbeat, WorkerIdentity
from workers.host import ENGINE_CHECK_S, WorkerHost
from workers.publisher import EventPublisher
from workers.task import TaskContext

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 3.0
REDIS_RETRIES = 4  # with the backoff below: about two seconds of retrying


def connect(redis_url: str) -> redis.Redis:
    """A client whose commands fail within seconds when Redis is unreachable."""
    return redis.Redis.from_url(
        redis_url,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=10,
        retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), REDIS_RETRIES),
    )


def terminate_self() -> None:
    """Begin this process's warm shutdown, as a supervisor's SIGTERM would.

    Celery's handler runs in the main thread and calls ``serve``'s
    ``on_shutdown``, so a dead engine ends the worker by the same path as a
    drain: no new jobs, every run handed back, the heartbeat key deleted.
    (Before Celery installs its handler, SIGTERM's default action ends the
    process, with a non-zero status as well.)
    """
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass(slots=True)
class WorkerRuntime:
    """The running parts of one worker; ``start`` builds them, ``stop`` ends them."""

    identity: WorkerIdentity
    client: redis.Redis
    host: WorkerHost
    cancellation: CancellationWatcher
    heartbeat: Heartbeat
    summary: CacheSummary
    link: BrokerLink
    context: TaskContext

    @classmethod
    def start(
        cls,
        redis_url: str,
        identity: WorkerIdentity,
        engine: LLMEngine,
        heartbeat_interval_s: float = keys.HEARTBEAT_INTERVAL_S,
        on_engine_death: Callable[[], None] = terminate_self,
        engine_check_s: float = ENGINE_CHECK_S,
    ) -> WorkerRuntime:
        """Start every thread; ``on_engine_death`` ends the process (tests observe it)."""
        client = connect(redis_url)
        maxlen = keys.event_stream_maxlen(engine.max_model_len)
        publisher = EventPublisher(client, identity.model, maxlen)
        summary = CacheSummary(client, identity.worker_id)
        host = WorkerHost(engine, publisher, on_engine_death, engine_check_s, summary.note)
        link = BrokerLink(identity.worker_id, identity.own_queue, intake=host.intake)
        runtime = cls(
            identity=identity,
            client=client,
            host=host,
            cancellation=CancellationWatcher(client, host.cancel, host.running),
            heartbeat=Heartbeat(
                client,
                identity,
                lambda: host.snapshot,
                lambda: host.draining,
                heartbeat_interval_s,
                summary=summary,
            ),
            summary=summary,
            link=link,
            context=TaskContext(
                client, publisher, host, identity.model, link.taken_key, link.starts
            ),
        )
        summary.start()
        host.start()
        runtime.cancellation.start()
        runtime.heartbeat.start()
        return runtime

    @property
    def engine_died(self) -> bool:
        """Whether the engine thread died (also when a shutdown began between the death and
        the watchdog's next look)."""
        return self.host.engine_died()

    def serve_metrics(self, port: int) -> None:
        """This worker's engine load on ``http://0.0.0.0:port/metrics`` (a thread of
        prometheus_client's), under vLLM's names (``shared.engine_metrics``): the host's
        snapshot is an ``EngineLoad``."""
        registry = CollectorRegistry(auto_describe=True)
        registry.register(EngineLoadCollector(self.identity.model, lambda: self.host.snapshot))
        start_http_server(port, registry=registry)
        log.info("engine metrics on http://0.0.0.0:%d/metrics", port)

    def drain_in_background(self, grace_s: float) -> threading.Thread:
        """Start the drain without blocking (it is begun from a signal handler)."""
        thread = threading.Thread(
            target=self.host.drain, args=(grace_s,), name="sluice-drain", daemon=True
        )
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop every thread; the worker leaves the registry last, once nothing runs."""
        self.cancellation.stop(timeout=5)
        self.host.stop(timeout=10)
        self.summary.stop(timeout=5)
        self.heartbeat.stop(timeout=5)
        self.client.close()
