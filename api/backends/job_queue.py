"""Putting a prepared request on a model's Celery queue, shared by every sender.

The synchronous path (``DistributedBackend``) and async jobs
(``api.jobs.worker_queue``) both send the same task the same way; what
differs is who owns the generation afterwards.
"""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime

from celery import Celery

from shared import keys
from shared.wire import Job, PreparedRequest, encode_job

SEND_TIMEOUT_S = 10.0
CELERY_PRIORITIES = range(10)  # kombu's Redis transport: 0 is served first


def sending_app(redis_url: str, name: str = "sluice-api") -> Celery:
    """A sending-only Celery app: fails fast rather than retrying while a client waits."""
    app = Celery(name, broker=redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        broker_connection_timeout=2,
        task_publish_retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
        },
    )
    return app


def send_job(app: Celery, job: Job) -> None:
    """Publish on the model's queue (a blocking call: run it on a thread)."""
    request, deadlines = job.request, job.deadlines
    expires = datetime.fromtimestamp(deadlines.queue, UTC) if deadlines.queue else None
    app.send_task(
        keys.TASK_NAME,
        args=[encode_job(job)],
        queue=keys.queue_name(request.model),
        priority=min(max(request.priority, CELERY_PRIORITIES[0]), CELERY_PRIORITIES[-1]),
        expires=expires,
    )


def with_seed(request: PreparedRequest) -> PreparedRequest:
    """A sampling request without a seed gets one, so every attempt draws the same tokens."""
    sampling = request.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seeded = dataclasses.replace(sampling, seed=random.SystemRandom().getrandbits(63))
    return dataclasses.replace(request, sampling=seeded)
