"""The multiplexed stream reader against a real Redis, with events written by hand.

Events are written the way workers write them (``encode_event``), so these
tests pin the reader's side of the contract without any worker: order, no
loss before the first read, prompt pickup of new streams, fencing, and a
Redis restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis

from api.backends.event_reader import EventReader, Subscription
from api.backends.request_queue import RequestQueue
from shared import keys
from shared.events import Accepted, Error, Finish, FinishReason, InferenceEvent, Ready, Text
from shared.sampling import SamplingParams
from shared.wire import Deadlines, PreparedRequest, QueuedRequest
from tests.distributed.conftest import RedisServer
from tests.streams import append_events

pytestmark = pytest.mark.distributed

T = TypeVar("T")


def write(server: RedisServer, request_id: str, attempt: int, *events: InferenceEvent) -> None:
    append_events(server.client, request_id, attempt, *events)


async def receive(subscription: Subscription, count: int, timeout: float = 5) -> list:
    return [await asyncio.wait_for(subscription.events.get(), timeout) for _ in range(count)]


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def read_stream(server: RedisServer, request_id: str, count: int) -> list:
    """The first ``count`` events a fresh reader delivers for ``request_id``."""

    async def scenario() -> list:
        reader = EventReader(server.url)
        await reader.start()
        try:
            return await receive(reader.open(request_id), count)
        finally:
            await reader.stop()

    return run(scenario())


def test_events_written_before_the_first_read_arrive_in_order(own_redis: RedisServer):
    events = [Ready("r1", 5, 0), Text("r1", "Hi", [1]), Text("r1", "!", [2]),
              Finish("r1", FinishReason.STOP, 2)]  # fmt: skip
    write(own_redis, "r1", 1, *events)

    async def scenario() -> list:
        reader = EventReader(own_redis.url)
        await reader.start()
        try:
            subscription = reader.open("r1")
            received = await receive(subscription, 4)
            assert reader.open_count == 0  # a finished stream is no longer read
            return received
        finally:
            await reader.stop()

    assert run(scenario()) == events


def test_a_new_stream_does_not_wait_for_the_blocked_read(own_redis: RedisServer):
    async def scenario() -> float:
        reader = EventReader(own_redis.url, block_ms=20_000)
        await reader.start()
        try:
            reader.open("idle")
            await asyncio.sleep(0.3)  # the reader is now blocked on "idle" alone
            subscription = reader.open("late")
            started = time.monotonic()
            write(own_redis, "late", 1, Ready("late", 3, 0))
            await receive(subscription, 1)
            return time.monotonic() - started
        finally:
            await reader.stop()

    assert run(scenario()) < 1.0


@pytest.mark.parametrize("bound", [0, 1], ids=["queued", "refused"])
def test_a_job_queued_with_the_interrupt_returns_the_blocked_read(
    own_redis: RedisServer, bound: int
):
    """The submit carries the interrupt (``take_interrupt``), once per blocked read, either way."""
    now = time.time()
    request = PreparedRequest("late", "wake-test", [1, 2], SamplingParams(max_tokens=2))
    own_redis.client.zadd(keys.inflight("wake-test"), {"other": now + 600})  # fills a bound of 1

    async def scenario() -> float:
        client = Redis.from_url(own_redis.url, decode_responses=True)
        reader = EventReader(own_redis.url, block_ms=20_000)
        await reader.start()
        try:
            reader.open("idle")
            await asyncio.sleep(0.3)  # the reader is now blocked on "idle" alone
            subscription = reader.open("late", interrupt=False)
            interrupt = reader.take_interrupt()
            assert interrupt is not None and reader.take_interrupt() is None  # one per blocked read
            job = QueuedRequest(request, Deadlines(total=now + 600), origin="wake-test-api")
            queued = (await RequestQueue(client).put(job, now + 600, bound, interrupt)).message
            assert (queued is None) == (bound == 1)
            started = time.monotonic()
            write(own_redis, "late", 1, Ready("late", 2, 0))
            await receive(subscription, 1)
            return time.monotonic() - started
        finally:
            await reader.stop()
            await client.aclose()

    assert run(scenario()) < 1.0


def test_a_stale_attempt_a_repeated_event_and_a_second_accepted_or_ready_are_dropped(
    own_redis: RedisServer,
):
    write(own_redis, "r2", 1, Accepted("r2"), Ready("r2", 4, 0), Text("r2", "a", [7]))
    write(own_redis, "r2", 2, Accepted("r2"), Ready("r2", 4, 0), Text("r2", "b", [8]))
    append_events(own_redis.client, "r2", 2, Text("r2", "b", [8]), seq=3)  # a write sent again
    write(own_redis, "r2", 1, Text("r2", "stale", [9]))
    write(own_redis, "r2", 2, Finish("r2", FinishReason.LENGTH, 2))

    received = read_stream(own_redis, "r2", 5)
    assert [type(event) for event in received] == [Accepted, Ready, Text, Text, Finish]
    assert [event.text for event in received[2:4]] == ["a", "b"]


def test_a_redis_restart_fails_open_requests_and_reading_resumes(own_redis: RedisServer):
    async def scenario() -> tuple[InferenceEvent, float, list]:
        reader = EventReader(own_redis.url, block_ms=1000)
        await reader.start()
        try:
            waiting = reader.open("lost")
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await asyncio.to_thread(own_redis.restart)
            failure = (await receive(waiting, 1, timeout=10))[0]
            elapsed = time.monotonic() - started
            fresh = reader.open("fresh")
            write(own_redis, "fresh", 1, Ready("fresh", 2, 0))
            return failure, elapsed, await receive(fresh, 1, timeout=10)
        finally:
            await reader.stop()

    failure, elapsed, after = run(scenario())
    assert isinstance(failure, Error) and failure.kind == "unavailable"
    assert elapsed < 5
    assert after == [Ready("fresh", 2, 0)]


def test_reads_that_keep_failing_end_open_requests_after_the_grace(own_redis: RedisServer):
    """The server answers, but every ``XREAD`` fails: that is an outage too.

    A key of the wrong type under a request's stream name makes the whole
    multi-stream ``XREAD`` fail with ``WRONGTYPE`` on each try.
    """
    own_redis.client.set(keys.event_stream("clobbered"), "not a stream")

    async def scenario() -> tuple[InferenceEvent, InferenceEvent, float]:
        reader = EventReader(own_redis.url, block_ms=1000, outage_grace_s=1.0)
        await reader.start()
        try:
            started = time.monotonic()
            bystander, clobbered = reader.open("bystander"), reader.open("clobbered")
            failures = [(await receive(sub, 1))[0] for sub in (bystander, clobbered)]
            return failures[0], failures[1], time.monotonic() - started
        finally:
            await reader.stop()
            own_redis.client.delete(keys.event_stream("clobbered"))

    first, second, elapsed = run(scenario())
    assert isinstance(first, Error) and first.kind == "unavailable" and "WRONGTYPE" in first.message
    assert isinstance(second, Error) and second.kind == "unavailable"
    assert elapsed < 4
