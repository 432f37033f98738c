"""A generation that outlasts the visibility timeout is not redelivered while it runs."""

from __future__ import annotations

import time

import redis

from shared import keys
from shared.events import Finish
from shared.sampling import SamplingParams
from tests.workers.conftest import (
    MAX_MODEL_LEN,
    PROMPT,
    QUEUE,
    VISIBILITY_TIMEOUT_S,
    Producer,
    wait_until,
)
from workers.runtime import WorkerRuntime

SWEEP_INTERVAL_S = 1  # what create_app derives from the tests' visibility timeout


def test_running_job_stays_invisible_past_the_visibility_timeout(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    params = SamplingParams(
        max_tokens=MAX_MODEL_LEN - len(PROMPT) - 1, temperature=0.0, ignore_eos=True
    )
    request_id = producer.send(params)
    stream = keys.event_stream(request_id)
    wait_until(lambda: client.xlen(stream) >= 2, 30, "the first token")

    time.sleep(VISIBILITY_TIMEOUT_S + 2 * SWEEP_INTERVAL_S)

    events = producer.events(request_id)
    assert not isinstance(events[-1], Finish), "the generation ended too soon to show anything"
    assert client.get(keys.lease(request_id)) == b"1"
    assert client.hlen("unacked") == 1 and client.llen(QUEUE) == 0
    client.set(keys.cancel_flag(request_id), 1, ex=60)
    client.publish(keys.CANCEL_CHANNEL, request_id)
    producer.wait_end(request_id)
    assert {entry.attempt for entry in producer.entries(request_id)} == {1}
