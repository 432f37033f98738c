"""Everything a worker process runs beside Celery, started and stopped together.

The engine host, the cancel watcher and the heartbeat are threads of their
own that share one Redis client (redis-py pools connections and is
thread-safe). The client retries briefly on connection errors and never
waits on a socket for long, so when Redis goes away a write fails within
seconds (the runs it concerned are stopped and handed back) and the threads
carry on and reconnect once it is back.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from shared import keys
from workers.cancellation import CancellationWatcher
from workers.heartbeat import Heartbeat, WorkerIdentity
from workers.host import WorkerHost
from workers.publisher import EventPublisher
from workers.task import TaskContext
from workers.visibility import DeliveryTracker

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


@dataclass(slots=True)
class WorkerRuntime:
    """The running parts of one worker; ``start`` builds them, ``stop`` ends them."""

    identity: WorkerIdentity
    client: redis.Redis
    host: WorkerHost
    cancellation: CancellationWatcher
    heartbeat: Heartbeat
    deliveries: DeliveryTracker
    context: TaskContext

    @classmethod
    def start(
        cls,
        redis_url: str,
        identity: WorkerIdentity,
        engine: LLMEngine,
        heartbeat_interval_s: float = 1.0,
    ) -> WorkerRuntime:
        client = connect(redis_url)
        maxlen = keys.event_stream_maxlen(engine.max_model_len)
        publisher = EventPublisher(client, identity.model, maxlen)
        host = WorkerHost(engine, publisher)
        deliveries = DeliveryTracker()
        runtime = cls(
            identity=identity,
            client=client,
            host=host,
            cancellation=CancellationWatcher(client, host.cancel, host.request_ids),
            heartbeat=Heartbeat(
                client,
                identity,
                lambda: host.snapshot,
                lambda: host.draining,
                deliveries,
                heartbeat_interval_s,
            ),
            deliveries=deliveries,
            context=TaskContext(client, publisher, host, identity.model),
        )
        deliveries.connect()
        host.start()
        runtime.cancellation.start()
        runtime.heartbeat.start()
        return runtime

    def drain_in_background(self, grace_s: float) -> threading.Thread:
        """Start the drain without blocking (it is begun from a signal handler)."""
        thread = threading.Thread(
            target=self.host.drain, args=(grace_s,), name="sluice-drain", daemon=True
        )
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop every thread; the heartbeat key is deleted last, once nothing runs."""
        self.deliveries.disconnect()
        self.cancellation.stop(timeout=5)
        self.host.stop(timeout=10)
        self.heartbeat.stop(timeout=5)
        self.client.close()
