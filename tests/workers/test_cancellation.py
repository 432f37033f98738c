"""Cancellation: before a job starts it never reaches the engine; during one it stops at once.

The same holds for a job whose origin, the API process its client waits on,
has died: nobody can cancel it any more, and nobody would read its events.
"""

from __future__ import annotations

import uuid

import redis

from shared import keys
from shared.events import Finish, FinishReason, Text
from shared.sampling import SamplingParams
from tests.workers.conftest import MAX_MODEL_LEN, PROMPT, Producer, wait_until
from workers.cancellation import CATCH_UP_INTERVAL_S
from workers.runtime import WorkerRuntime

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _cancel(client: redis.Redis, request_id: str) -> None:
    """What the API does when a client goes away."""
    client.set(keys.cancel_flag(request_id), 1, ex=60)
    client.publish(keys.CANCEL_CHANNEL, request_id)


def test_job_cancelled_before_it_starts_never_reaches_the_engine(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    request_id = uuid.uuid4().hex
    steps = worker.host.snapshot.steps
    _cancel(client, request_id)

    producer.send(LONG, request_id=request_id)

    assert producer.wait_end(request_id) == [Finish(request_id, FinishReason.ABORT, 0)]
    assert worker.host.snapshot.steps == steps


def test_job_cancelled_while_generating_stops_within_a_step(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    aborted = worker.host.snapshot.aborted
    request_id = producer.send(LONG)
    stream = keys.event_stream(request_id)
    wait_until(lambda: client.xlen(stream) >= 4, 30, "a few tokens")

    _cancel(client, request_id)
    written_at_cancel = client.xlen(stream)
    events = producer.wait_end(request_id, timeout=10)

    assert isinstance(events[-1], Finish) and events[-1].reason is FinishReason.ABORT
    # at most the step running when the cancel was sent and the next (the cancel reaches the
    # engine thread through Redis and the worker's listener thread, which may wait out
    # Python's 5 ms switch interval for the GIL: longer than a step of this one-sequence
    # batch), then the Finish
    assert len(events) - written_at_cancel <= 3
    assert events[-1].completion_tokens == sum(isinstance(event, Text) for event in events)
    wait_until(lambda: producer.heartbeat()["aborted"] > aborted, 5, "the abort in the heartbeat")
    assert producer.heartbeat()["running"] == 0


def test_a_malformed_message_on_the_cancel_channel_leaves_cancels_working(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    client.publish(keys.CANCEL_CHANNEL, b"\xff\xfe not UTF-8")
    request_id = producer.send(LONG)
    stream = keys.event_stream(request_id)
    wait_until(lambda: client.xlen(stream) >= 4, 30, "a few tokens")

    _cancel(client, request_id)
    events = producer.wait_end(request_id, timeout=10)

    assert isinstance(events[-1], Finish) and events[-1].reason is FinishReason.ABORT
    assert len(events) < LONG.max_tokens


def test_cancel_heard_before_its_run_reaches_the_engine_still_stops_it(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    """A cancel published after the task read the flag, but before it submitted its run."""
    from shared.registry import DEFAULT_MODEL
    from shared.wire import PreparedRequest
    from workers.host import Outcome, Run

    request_id = uuid.uuid4().hex
    worker.host.cancel(request_id)  # what the watcher does with a cancel it hears
    attempt = int(client.incr(keys.lease(request_id)))
    request = PreparedRequest(request_id, DEFAULT_MODEL, [1, 9690, 314, 253], LONG, created=0.0)
    run = Run(request, attempt)

    worker.host.submit(run)

    assert run.wait(30) is Outcome.FINISHED
    events = producer.events(request_id)
    assert isinstance(events[-1], Finish) and events[-1].reason is FinishReason.ABORT
    assert sum(isinstance(event, Text) for event in events) <= 1


def test_job_whose_api_process_is_gone_never_reaches_the_engine(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    steps = worker.host.snapshot.steps

    request_id = producer.send(LONG, origin=f"gone-{uuid.uuid4().hex}")  # its key never existed

    assert producer.wait_end(request_id) == [Finish(request_id, FinishReason.ABORT, 0)]
    assert worker.host.snapshot.steps == steps


def test_running_job_stops_once_its_api_process_is_gone(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    origin = f"api-{uuid.uuid4().hex}"
    client.set(keys.api_process(origin), 1, ex=60)
    whole = SamplingParams(
        max_tokens=MAX_MODEL_LEN - len(PROMPT) - 1, temperature=0.0, ignore_eos=True
    )
    request_id = producer.send(whole, origin=origin)
    stream = keys.event_stream(request_id)
    wait_until(lambda: client.xlen(stream) >= 4, 30, "a few tokens")
    assert worker.host.running() == {request_id: origin}

    client.delete(keys.api_process(origin))  # as when its TTL runs out after the process died

    events = producer.wait_end(request_id, timeout=CATCH_UP_INTERVAL_S + 5)
    assert isinstance(events[-1], Finish) and events[-1].reason is FinishReason.ABORT
    assert events[-1].completion_tokens < whole.max_tokens
