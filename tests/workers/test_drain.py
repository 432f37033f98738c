"""A drain whose grace runs out hands the run back; another worker finishes it exactly.

The worker being drained here is a second host of this process, on the same
weights, driven through the task's own code (``run_job``) the way Celery's
thread would; the job it hands back goes to the head of the queue (that
order is ``test_requeue.py``'s to check), where the suite's running worker
takes it and resumes from the stream. (The whole worker process under
SIGTERM is ``tests/distributed/test_drain.py``.)
"""

from __future__ import annotations

import threading
import time
import uuid

import redis

from engine.llm_engine import LLMEngine
from shared import keys
from shared.events import Finish, FinishReason
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, encode_queued
from tests.workers.conftest import (
    PROMPT,
    Producer,
    Reference,
    engine_on_the_same_weights,
    take_as_a_worker,
    task_context,
    text_of,
    tokens_of,
    wait_until,
)
from workers.host import WorkerHost
from workers.publisher import EventPublisher
from workers.runtime import WorkerRuntime, connect
from workers.task import run_job

LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)  # outlasts the grace
GRACE_S = 0.05


def test_a_run_outlasting_the_grace_is_handed_back_and_resumed_elsewhere(
    worker: WorkerRuntime,
    producer: Producer,
    engine: LLMEngine,
    reference: Reference,
    redis_url: str,
    client: redis.Redis,
) -> None:
    own = connect(redis_url)
    publisher = EventPublisher(own, DEFAULT_MODEL)
    host = WorkerHost(engine_on_the_same_weights(engine), publisher)
    host.start()
    request_id = uuid.uuid4().hex
    request = PreparedRequest(request_id, DEFAULT_MODEL, PROMPT, LONG, created=time.time())
    context = task_context(own, publisher, host)
    job = QueuedRequest(request, Deadlines())
    take_as_a_worker(own, context, [job])
    task = threading.Thread(target=run_job, args=(context, encode_queued(job)))
    try:
        task.start()
        wait_until(lambda: len(producer.events(request_id)) >= 4, 30, "tokens to flow")

        assert host.drain(GRACE_S) == 1
        task.join(10)
        assert not own.exists(context.taken_key)  # its record went back with it, unacked
        events = producer.wait_end(request_id, timeout=60)  # resumed by the suite's worker
    finally:
        host.stop(10)
        own.close()

    assert not task.is_alive()
    entries = producer.entries(request_id)
    assert entries[0].attempt == 1 and entries[-1].attempt == 2
    expected = reference(PROMPT, LONG)
    assert text_of(events) == text_of(expected)
    assert tokens_of(events) == tokens_of(expected)
    assert events[-1] == Finish(request_id, FinishReason.LENGTH, LONG.max_tokens, None)
    assert client.llen(keys.queue_name(DEFAULT_MODEL)) == 0  # taken, not left behind
