"""The workers' Celery app: Redis broker, thread pool, late acks, no result backend.

One process holds the model, so the pool is threads: a task thread only
waits while the engine thread generates. Concurrency is the engine's
``max_num_seqs`` and the prefetch multiplier 1, so a worker reserves no
more jobs than its engine can batch; the rest stay in Redis for other
workers. Messages are acked when the generation has ended (``acks_late``):
until then each is in its worker's taken records (``keys.taken``), which go
back to the head of their queues when the worker dies, leaves or closes
its channel (``workers.broker.transport``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.worker.request import Request
from kombu import Exchange, Queue

from workers.broker import BrokerLink
from workers.broker.transport import LINK_OPTION, Transport

BROKER_SOCKET_TIMEOUT_S = 10  # a vanished broker fails a command instead of hanging it


class ResumableRequest(Request):
    """A request Celery never expires.

    A message's ``expires`` would make Celery drop an expired job
    unanswered, and drop a redelivered job that had already started
    streaming; the task applies the queue deadline itself, to jobs that have
    not started (``workers.task``).
    """

    @property
    def expires(self) -> None:
        return None

    @expires.setter
    def expires(self, value: Any) -> None:
        pass


def broker_transport_options(link: BrokerLink) -> dict[str, Any]:
    """Transport options: this worker's link and bounded socket waits."""
    return {
        LINK_OPTION: link,
        "socket_timeout": BROKER_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 10,
    }


def consumed_queues(names: Sequence[str]) -> list[Queue]:
    """Queues as Celery declares one named by ``send_task(queue=name)``: direct, keyed by name."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in names]


def create_app(redis_url: str, queues: Sequence[str], concurrency: int, link: BrokerLink) -> Celery:
    """A Celery app that consumes exactly ``queues`` (the first is the model's own)."""
    app = Celery("sluice-worker", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_queues=consumed_queues(queues),
        task_default_queue=queues[0],
        worker_pool="threads",
        worker_concurrency=concurrency,
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        broker_transport=Transport,
        broker_transport_options=broker_transport_options(link),
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a worker outlives any Redis outage
        worker_cancel_long_running_tasks_on_connection_loss=False,  # generations go on
        worker_enable_remote_control=False,  # no pidbox queues: workers are found by heartbeat
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app
