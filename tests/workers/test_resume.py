"""A redelivered job continues its request from the stream, and a stale attempt is stopped."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import redis

from shared import keys
from shared.events import Finish, Ready, Text
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from tests.workers.conftest import (
    PROMPT,
    WORKER_ID,
    Producer,
    Reference,
    text_of,
    tokens_of,
    wait_until,
)
from workers.publisher import Batch, EventPublisher
from workers.runtime import WorkerRuntime


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resumed_job_continues_exactly_where_the_last_attempt_stopped(
    worker: WorkerRuntime,
    producer: Producer,
    client: redis.Redis,
    reference: Reference,
    temperature: float,
) -> None:
    # a stop string that never matches makes the engine hold text back
    params = SamplingParams(
        max_tokens=24, temperature=temperature, seed=7, ignore_eos=True, stop=["zzqx"]
    )
    whole = reference(PROMPT, params)
    cut = 9
    request_id = uuid.uuid4().hex
    earlier = [Ready(request_id, len(PROMPT), 0)] + [
        Text(request_id, event.text, event.token_ids) for event in whole[:cut]
    ]
    client.set(keys.lease(request_id), 1)
    EventPublisher(client, DEFAULT_MODEL).publish([Batch(request_id, 1, 1, earlier)])

    producer.send(params, request_id=request_id)
    producer.wait_end(request_id)
    entries = producer.entries(request_id)

    events = [entry.event for entry in entries]
    assert sum(isinstance(event, Ready) for event in events) == 1
    assert {entry.attempt for entry in entries[len(earlier) :]} == {2}
    assert text_of(events) == text_of(whole)
    assert tokens_of(events) == tokens_of(whole)
    assert events[-1] == dataclasses.replace(whole[-1], request_id=request_id)


def test_attempt_fenced_out_by_a_newer_one_stops_generating(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    aborted = worker.host.snapshot.aborted
    request_id = producer.send(SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    stream = keys.event_stream(request_id)
    wait_until(lambda: client.xlen(stream) >= 3, 30, "a few tokens")

    client.incr(keys.lease(request_id))  # a redelivery elsewhere took the request over

    wait_until(lambda: worker.host.snapshot.aborted > aborted, 5, "the stale run aborted")
    wait_until(lambda: client.hlen(keys.taken(WORKER_ID)) == 0, 5, "its message acked")
    written = client.xlen(stream)
    assert worker.host.snapshot.runs == 0
    assert not any(isinstance(event, Finish) for event in producer.events(request_id))
    assert client.xlen(stream) == written
