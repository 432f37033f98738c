"""The workers' Celery app: Redis broker, thread pool, late acks, no result backend.

One process holds the model, so the pool is threads: a task thread only
waits while the engine thread generates. Concurrency is the engine's
``max_num_seqs`` and the prefetch multiplier 1, so a worker reserves no
more jobs than its engine can batch; the rest stay in Redis for other
workers. Messages are acked when the generation has ended (``acks_late``), so
a job whose worker dies is delivered again.

Redelivery with kombu's Redis transport (5.7, read and tried): an unacked
message waits in ``unacked``/``unacked_index`` and is moved back to its
queue by a sweep that every consuming worker runs every
``unacked_restore_interval`` seconds, but scans only on every
``unacked_restore_throttle``-th tick (default 10 x 10 s). A message is swept
once its delivery time (here: its last refresh, see ``workers.visibility``)
is older than ``visibility_timeout``. With the throttle at 1 and the interval
a fraction of the timeout, a dead worker's job is back in its queue
``visibility_timeout`` plus at most one interval after its last refresh,
provided some worker for that queue is alive to sweep (a restarting worker
sweeps when it starts polling). A sweep runs under a Redis lock that expires
by itself; kombu's default expiry is 300 s, so a worker killed mid-sweep would
hold every other worker's sweep, and its own job's redelivery, for five
minutes. Here the lock lasts one sweep interval: overlapping sweeps are
harmless (each restore is a transaction watching ``unacked``).

A warm shutdown's hand-back does not wait for any of this: the task pushes
the job to the head of its queue at once and acks the old message (see
``workers.task``; kombu's own requeue of a reject would ``LPUSH`` it to the
tail, while a swept message goes to the head).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from workers.intake import TRANSPORT_OPTION, Intake
from workers.taken import TRANSPORT_OPTION as TAKEN_OPTION
from workers.taken import TakenStarts
from workers.transport import Transport
from workers.visibility import UNACKED_INDEX_KEY, UNACKED_MUTEX_KEY

DEFAULT_VISIBILITY_TIMEOUT_S = 15
"""Seconds after a job's last refresh that the sweep hands it to another worker.

Running jobs are refreshed with every heartbeat (``workers.visibility``, every
``REFRESH_INTERVAL_S`` = 1 s), so this bounds only how long a dead worker's
jobs wait, not how long a generation may run; a live worker would have to
miss 15 refreshes in a row to lose its job (the worker refuses a timeout
under three). A job whose worker is killed is back in its queue within this
plus one refresh and one sweep interval (3 s here): about 19 s, well inside
the API's default queue (30 s) and first-token (60 s) deadlines, so the
resumed attempt can still answer. At 60 s, a kill before the first token
meant a 504 before the job came back, and a kill mid-stream a minute's stall.
"""
BROKER_SOCKET_TIMEOUT_S = 10  # a vanished broker fails a command instead of hanging it


def broker_transport_options(
    visibility_timeout_s: float, intake: Intake | None = None, taken: TakenStarts | None = None
) -> dict[str, Any]:
    """Transport options: the redelivery timing above, bounded socket waits, intake, starts."""
    sweep_interval_s = max(1, min(10, round(visibility_timeout_s / 5)))
    return {
        TRANSPORT_OPTION: intake,
        TAKEN_OPTION: taken,
        "visibility_timeout": visibility_timeout_s,
        "unacked_index_key": UNACKED_INDEX_KEY,
        "unacked_restore_interval": sweep_interval_s,
        "unacked_restore_throttle": 1,
        "unacked_mutex_key": UNACKED_MUTEX_KEY,
        "unacked_mutex_expire": sweep_interval_s,
        "socket_timeout": BROKER_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 10,
    }


def consumed_queues(names: Sequence[str]) -> list[Queue]:
    """Queues as Celery declares one named by ``send_task(queue=name)``: direct, keyed by name."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in names]


def create_app(
    redis_url: str,
    queues: Sequence[str],
    concurrency: int,
    visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S,
    intake: Intake | None = None,
    taken: TakenStarts | None = None,
) -> Celery:
    """A Celery app that consumes exactly ``queues`` (the first is the model's own).

    ``intake``: the engine's, so that a worker whose KV cache is full takes
    no more jobs (``workers.intake``). ``taken``: the tasks', where the take
    script leaves the jobs it started (``workers.taken``).
    """
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
        broker_transport=Transport,  # kombu's Redis transport, taking bursts at once
        broker_transport_options=broker_transport_options(visibility_timeout_s, intake, taken),
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a worker outlives any Redis outage
        worker_cancel_long_running_tasks_on_connection_loss=False,  # generations go on
        worker_enable_remote_control=False,  # no pidbox queues: workers are found by heartbeat
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app
