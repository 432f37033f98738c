"""The ``sluice.generate`` task, end to end through Celery, Redis and the engine."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis

from shared import keys
from shared.events import Accepted, Error, Finish, FinishReason, Ready, Text
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.task_message import REQUEST_HEADER
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, encode_queued
from tests.workers.conftest import (
    PROMPT,
    QUEUE,
    WORKER_ID,
    Producer,
    Reference,
    take_as_a_worker,
    task_context,
    text_of,
    tokens_of,
    wait_until,
)
from workers.publisher import Batch, EventPublisher
from workers.runtime import WorkerRuntime
from workers.task import StartFailed, run_job

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_greedy_job_streams_what_offline_generation_produces(
    worker: WorkerRuntime, producer: Producer, reference: Reference
) -> None:
    request_id = producer.send(GREEDY)
    producer.wait_end(request_id)
    entries = producer.entries(request_id)

    expected = reference(PROMPT, GREEDY)
    events = [entry.event for entry in entries]
    assert {entry.attempt for entry in entries} == {1}
    assert [entry.seq for entry in entries] == list(range(1, len(entries) + 1))
    assert events[:2] == [Accepted(request_id), Ready(request_id, len(PROMPT), 0)]
    assert text_of(events) == text_of(expected)
    assert tokens_of(events) == tokens_of(expected)
    assert events[-1] == Finish(request_id, FinishReason.LENGTH, GREEDY.max_tokens, None)
    assert sum(isinstance(event, Accepted | Ready) for event in events) == 2
    assert 0 < producer.client.ttl(keys.event_stream(request_id)) <= keys.FINISHED_STREAM_TTL_S
    # resolved by the outbox thread, counted again by the engine thread's snapshot
    wait_until(lambda: worker.host.snapshot.runs == 0, 5, "the run to leave the snapshot")


def test_a_named_job_runs_on_the_start_its_take_made(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    request_id = uuid.uuid4().hex
    request = PreparedRequest(request_id, DEFAULT_MODEL, PROMPT, GREEDY, created=time.time())
    steps = worker.host.snapshot.steps
    # Only the take script reads the header, here naming an API process that is gone:
    # a task that started the job itself would find no origin to check and run it.
    header = {REQUEST_HEADER: [request_id, "an-api-process-that-is-gone"]}
    producer.send_payload(encode_queued(QueuedRequest(request, Deadlines(), origin=None)), header)

    events = producer.wait_end(request_id)

    assert len(events) == 1 and isinstance(events[0], Finish)
    assert events[0].reason == FinishReason.ABORT and events[0].completion_tokens == 0
    assert worker.host.snapshot.steps == steps  # dropped unrun
    assert client.get(keys.lease(request_id)) == b"1"  # the task took no attempt of its own
    assert len(worker.context.starts) == 0


def test_a_job_its_message_does_not_name_is_refused_unrun(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    """Only the take script starts a job; a message naming none has nobody to start it."""
    steps = worker.host.snapshot.steps
    request_id = producer.send(GREEDY, named=False)  # as from a producer of its own

    (refusal,) = producer.wait_end(request_id)

    assert isinstance(refusal, Error) and "names no job" in refusal.message
    assert worker.host.snapshot.steps == steps
    wait_until(lambda: client.hlen(keys.taken(WORKER_ID)) == 0, 5, "the message acked")


def test_job_of_an_unknown_version_is_refused_without_requeue(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    request_id = uuid.uuid4().hex
    producer.send_payload(json.dumps({"v": 99, "request": {"request_id": request_id}}))

    # the job after it runs, so the bad one was taken, refused, and not put back
    producer.wait_end(producer.send(SamplingParams(max_tokens=1, temperature=0.0)))
    assert client.llen(QUEUE) == 0
    wait_until(lambda: client.hlen(keys.taken(WORKER_ID)) == 0, 5, "every message acked")
    (refusal,) = producer.events(request_id)  # its client hears why at once
    assert isinstance(refusal, Error) and "version 99" in refusal.message


def test_job_past_its_queue_deadline_gets_queue_timeout(
    worker: WorkerRuntime, producer: Producer
) -> None:
    steps = worker.host.snapshot.steps
    request_id = producer.send(GREEDY, deadlines=Deadlines(queue=time.time() - 1))

    events = producer.wait_end(request_id)

    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].kind == "queue_timeout"
    assert worker.host.snapshot.steps == steps  # never reached the engine


def test_job_whose_stream_already_ended_is_only_acked(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    request_id = uuid.uuid4().hex
    client.set(keys.lease(request_id), 1)
    done = [
        Ready(request_id, 7, 0),
        Text(request_id, "x", [5]),
        Finish(request_id, FinishReason.STOP, 1),
    ]
    EventPublisher(client, DEFAULT_MODEL).publish([Batch(request_id, 1, 1, done)])

    producer.send(GREEDY, request_id=request_id)

    wait_until(lambda: client.get(keys.lease(request_id)) == b"2", 10, "the redelivery's attempt")
    wait_until(lambda: client.hlen(keys.taken(WORKER_ID)) == 0, 5, "the message acked")
    assert producer.events(request_id) == done


def test_job_for_another_model_is_answered_with_an_error(
    worker: WorkerRuntime, producer: Producer
) -> None:
    request_id = producer.send(GREEDY, model="some-other-model")

    events = producer.wait_end(request_id)

    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].kind == "invalid_request" and "some-other-model" in events[0].message


def test_a_start_whose_replies_cannot_be_read_fails_its_job_alone(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    """The take script reads every job of a burst; a clobbered stream fails only its own job."""
    clobbered, fine = uuid.uuid4().hex, uuid.uuid4().hex
    client.set(keys.event_stream(clobbered), "not a stream")  # XRANGE: WRONGTYPE
    context = task_context(client, worker.context.publisher, worker.host)
    jobs = [QueuedRequest(prepared(clobbered)), QueuedRequest(prepared(fine))]
    take_as_a_worker(client, context, jobs)
    client.delete(keys.event_stream(clobbered))  # so that the failure report can be read

    with pytest.raises(StartFailed, match="WRONGTYPE"):
        run_job(context, encode_queued(jobs[0]))
    run_job(context, encode_queued(jobs[1]))

    (failure,) = producer.events(clobbered)
    assert isinstance(failure, Error) and "WRONGTYPE" in failure.message
    events = producer.events(fine)
    assert isinstance(events[-1], Finish) and text_of(events)


def prepared(request_id: str) -> PreparedRequest:
    return PreparedRequest(request_id, DEFAULT_MODEL, PROMPT, GREEDY, created=time.time())
