"""``DistributedBackend`` in this process against a real Redis, with no worker at all.

The test plays the worker: it takes the job off the Celery list, writes
events with the workers' codec and watches the cancel channel. That pins the
API side of the contract (job shape, in-flight set, cancellation, deadlines,
admission) in well under a second per test.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from api.backends.channel import RENEW_S
from api.backends.distributed import DistributedBackend
from api.backends.fleet import fleet_load
from api.error_kinds import ERROR_STATUSES, api_error
from api.errors import ApiError
from api.limits import Limits
from api.settings import Settings
from shared import keys
from shared.events import Error, Finish, FinishReason, Ready, Text
from shared.registry import DEFAULT_MODEL, default_registry
from shared.sampling import SamplingParams
from shared.wire import PreparedRequest, QueuedRequest, decode_queued
from tests.distributed.conftest import ROOT, GhostWorker, RedisServer, wait_until
from tests.streams import append_events

pytestmark = pytest.mark.distributed

SPEC = default_registry().resolve("default")


def settings(server: RedisServer, **limits: float) -> Settings:
    return Settings(redis_url=server.url, limits=Limits(**limits))


def request(request_id: str, **sampling: object) -> PreparedRequest:
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **sampling})
    return PreparedRequest(request_id, DEFAULT_MODEL, [1, 2, 3], params, created=time.time())


def fake_worker(server: RedisServer, worker_id: str = "fake", **load: object) -> None:
    """A ghost worker, so admission sees a live worker (nothing consumes the queue)."""
    report = {"capacity": 4, "max_model_len": 512, **load}
    GhostWorker(server.client, worker_id).beat(ttl_s=30, **report)


def take_job(server: RedisServer) -> tuple[QueuedRequest, dict]:
    """Pop the next job from the model's Celery list, as a worker would receive it."""
    raw = wait_until(
        lambda: server.client.rpop(keys.queue_name(DEFAULT_MODEL)), 5, "a job on the queue"
    )
    message = json.loads(raw)
    args, _, _ = json.loads(base64.b64decode(message["body"]))
    return decode_queued(args[0]), message


def write(server: RedisServer, request_id: str, *events: object, attempt: int = 1) -> None:
    append_events(server.client, request_id, attempt, *events)


async def started(backend: DistributedBackend) -> DistributedBackend:
    await backend.start()
    while not backend.health().ready:
        await asyncio.sleep(0.05)
    return backend


@pytest.fixture
def server(own_redis: RedisServer) -> RedisServer:
    own_redis.client.flushall()
    fake_worker(own_redis)
    return own_redis


def test_the_module_does_not_import_torch(own_redis: RedisServer):
    code = (
        "import sys\n"
        "from api.app import create_app\nfrom api.settings import Settings\n"
        f"create_app(Settings(redis_url={own_redis.url!r}))\n"
        "heavy = [name for name in ('torch', 'engine', 'workers') if name in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_a_job_is_queued_and_its_events_come_back(server: RedisServer):
    async def scenario() -> tuple[list, QueuedRequest, dict, list[str]]:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            events = backend.infer(request("req-1"))
            first = asyncio.ensure_future(anext(events))
            job, message = await asyncio.to_thread(take_job, server)
            inflight = server.client.zrange(keys.inflight(DEFAULT_MODEL), 0, -1)
            write(server, "req-1", Ready("req-1", 3, 0), Text("req-1", "Hi", [5]),
                  Finish("req-1", FinishReason.LENGTH, 1))  # fmt: skip
            received = [await first] + [event async for event in events]
            return received, job, message, inflight
        finally:
            await backend.stop()

    received, job, message, inflight = asyncio.run(scenario())
    assert [type(event) for event in received] == [Ready, Text, Finish]
    assert (job.request.request_id, job.request.prompt_token_ids) == ("req-1", [1, 2, 3])
    assert job.deadlines.queue < job.deadlines.first_token < job.deadlines.total
    assert message["headers"]["task"] == keys.TASK_NAME
    assert message["headers"]["expires"]  # the queue deadline, for Celery
    assert inflight == ["req-1"]
    assert job.origin is not None  # this API process, alive while its key is renewed
    assert 0 < server.client.ttl(keys.api_process(job.origin)) <= keys.API_PROCESS_TTL_S
    wait_until(lambda: not server.client.exists(keys.inflight(DEFAULT_MODEL)), 5, "ZREM")
    assert not server.client.exists(keys.cancel_flag("req-1"))  # it finished: nothing to cancel


def test_a_job_sets_its_origin_key_when_redis_lost_it(server: RedisServer):
    """After a Redis restart the key is gone until the next renewal, a second
    away; a job queued meanwhile must not look orphaned to the worker."""

    async def scenario() -> tuple[QueuedRequest, int]:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            for key in server.client.scan_iter(keys.api_process("*")):
                server.client.delete(key)  # as after a restart that lost the data
            events = backend.infer(request("req-origin"))
            first = asyncio.ensure_future(anext(events))
            job, _ = await asyncio.to_thread(take_job, server)
            ttl = server.client.ttl(keys.api_process(job.origin))
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            return job, ttl
        finally:
            await backend.stop()

    job, ttl = asyncio.run(scenario())
    assert job.origin is not None
    assert 0 < ttl <= keys.API_PROCESS_TTL_S


def test_an_unseeded_sampling_request_gets_a_seed(server: RedisServer):
    async def scenario() -> QueuedRequest:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            events = backend.infer(request("req-seed", temperature=0.8))
            task = asyncio.ensure_future(anext(events))
            job, _ = await asyncio.to_thread(take_job, server)
            task.cancel()  # the client leaves while waiting for the first event
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return job
        finally:
            await backend.stop()

    assert asyncio.run(scenario()).request.sampling.seed is not None


def test_a_client_leaving_at_any_moment_of_the_submission_cancels_the_request(
    server: RedisServer,
):
    """The reader is cancelled after 0, 1, 2, ... turns of the loop, so some cancel
    arrives as a command's reply does, where Python 3.11's ``wait_for`` (inside redis-py)
    returns the reply and drops the cancel: the generation still ends at once, cancelled."""

    async def scenario() -> list[str]:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        kept: list[str] = []  # the readers a cancel did not end
        try:
            for turns in range(40):
                events = backend.infer(request(f"req-leave-{turns}"))
                reader = asyncio.ensure_future(anext(events))
                for _ in range(turns):
                    await asyncio.sleep(0)
                reader.cancel()
                await asyncio.wait([reader], timeout=3)
                if not reader.cancelled():
                    kept.append(f"{turns}: {reader.result() if reader.done() else 'running'}")
                    reader.cancel()
        finally:
            await backend.stop()
        return kept

    assert asyncio.run(scenario()) == []
    submitted = [key for key in server.client.scan_iter("*") if "req-leave-" in key]
    assert submitted  # some were queued before their reader was cancelled
    assert not server.client.zrange(keys.inflight(DEFAULT_MODEL), 0, -1)


def test_closing_the_events_early_cancels_the_request(server: RedisServer):
    listener = server.client.pubsub()
    listener.subscribe(keys.CANCEL_CHANNEL)

    async def scenario() -> None:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            events = backend.infer(request("req-gone"))
            first = asyncio.ensure_future(anext(events))
            await asyncio.to_thread(take_job, server)
            write(server, "req-gone", Ready("req-gone", 3, 0))
            assert isinstance(await first, Ready)
            await events.aclose()  # the client went away
            await asyncio.sleep(0.2)
        finally:
            await backend.stop()

    asyncio.run(scenario())
    assert server.client.exists(keys.cancel_flag("req-gone"))
    messages = [listener.get_message(timeout=1) for _ in range(2)]
    assert any(m and m["type"] == "message" and m["data"] == "req-gone" for m in messages)
    assert not server.client.zrange(keys.inflight(DEFAULT_MODEL), 0, -1)


def test_a_cancel_that_found_redis_down_is_sent_once_it_answers(server: RedisServer):
    """A worker that kept its job through an outage must still hear that the client left."""

    async def scenario() -> None:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            events = backend.infer(request("req-outage"))
            first = asyncio.ensure_future(anext(events))
            await asyncio.to_thread(take_job, server)
            write(server, "req-outage", Ready("req-outage", 3, 0))
            assert isinstance(await first, Ready)
            server.kill()
            await events.aclose()  # the client leaves while Redis is down
            await asyncio.sleep(0.5)  # the cleanup fails
            server.start()  # empty: the restart lost everything
            flag = keys.cancel_flag("req-outage")
            while not await asyncio.to_thread(server.client.exists, flag):
                await asyncio.sleep(0.1)
            for key in server.client.scan_iter(keys.api_process("*")):
                server.client.delete(key)
            renewed = await asyncio.to_thread(
                wait_until, lambda: server.client.keys(keys.api_process("*")), 5 * RENEW_S,
                "the fleet watcher to renew the key: it goes on after sending the end",
            )  # fmt: skip
            assert renewed
        finally:
            await backend.stop()

    asyncio.run(asyncio.wait_for(scenario(), 15))


def test_ends_kept_through_an_outage_are_bounded_oldest_first(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("api.backends.channel.MAX_UNSENT_ENDS", 2)

    async def scenario() -> None:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            server.kill()
            for name in ("req-old", "req-mid", "req-new"):
                events = [event async for event in backend.infer(request(name))]
                assert isinstance(events[-1], Error) and events[-1].kind == "unavailable"
                await asyncio.sleep(0.2)  # its end fails, and is kept
            server.start()
            flags = [keys.cancel_flag("req-mid"), keys.cancel_flag("req-new")]
            while await asyncio.to_thread(server.client.exists, *flags) < 2:
                await asyncio.sleep(0.1)
        finally:
            await backend.stop()

    asyncio.run(asyncio.wait_for(scenario(), 20))
    assert not server.client.exists(keys.cancel_flag("req-old"))


@pytest.mark.parametrize(
    ("written", "kind"),
    [
        ((), "queue_timeout"),
        ((Ready("req-late", 3, 0),), "first_token_timeout"),
        ((Ready("req-late", 3, 0), Text("req-late", "a", [1])), "total_timeout"),
    ],
)
def test_a_missed_deadline_ends_the_request_and_cancels_it(
    server: RedisServer, written: tuple, kind: str
):
    limits = {"queue_timeout_s": 0.4, "first_token_timeout_s": 0.8, "total_timeout_s": 1.5}

    async def scenario() -> list:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server, **limits)))
        try:
            events = backend.infer(request("req-late"))
            first = asyncio.ensure_future(anext(events))
            await asyncio.to_thread(take_job, server)
            write(server, "req-late", *written)
            received = [await first] + [event async for event in events]
            await asyncio.sleep(0.2)
            return received
        finally:
            await backend.stop()

    received = asyncio.run(scenario())
    assert received[:-1] == list(written)
    assert isinstance(received[-1], Error) and received[-1].kind == kind
    assert server.client.exists(keys.cancel_flag("req-late"))


@contextlib.asynccontextmanager
async def bound_to_one(server: RedisServer) -> AsyncIterator[DistributedBackend]:
    """A started backend whose model admits one outstanding request."""
    backend = await started(DistributedBackend(server.url, SPEC, settings(server, max_inflight=1)))
    try:
        yield backend
    finally:
        await backend.stop()


@pytest.mark.parametrize("ends_with", ["finish", "queue_timeout"])
def test_a_request_s_place_is_free_when_its_last_event_arrives(server: RedisServer, ends_with: str):
    """A client that sends its next request on seeing the last event is not refused: the
    in-flight set has let the ended request go before that event is handed out."""
    limits = {"max_inflight": 1, "queue_timeout_s": 0.4}

    async def scenario() -> tuple[object, list[str]]:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server, **limits)))
        try:
            events = backend.infer(request("req-once"))
            first = asyncio.ensure_future(anext(events))
            if ends_with == "finish":
                await asyncio.to_thread(take_job, server)
                write(server, "req-once", Ready("req-once", 3, 0),
                      Finish("req-once", FinishReason.STOP, 0))  # fmt: skip
            last = await first
            while not isinstance(last, Finish | Error):
                last = await anext(events)
            held = server.client.zrange(keys.inflight(DEFAULT_MODEL), 0, -1)
            await events.aclose()
            return last, held
        finally:
            await backend.stop()

    last, held = asyncio.run(scenario())
    assert isinstance(last, Finish if ends_with == "finish" else Error)
    assert held == []


def test_admission_refuses_beyond_the_in_flight_bound(server: RedisServer):
    server.client.zadd(keys.inflight(DEFAULT_MODEL), {"someone-else": time.time() + 60})

    async def scenario() -> ApiError:
        async with bound_to_one(server) as backend:
            with pytest.raises(ApiError) as refused:
                await backend.admit()
            return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}


def test_a_place_freed_since_the_snapshot_is_not_refused(server: RedisServer):
    server.client.zadd(keys.inflight(DEFAULT_MODEL), {"someone-else": time.time() + 60})

    async def scenario() -> int:
        async with bound_to_one(server) as backend:
            while backend.snapshot.outstanding < 1:
                await asyncio.sleep(0.05)
            server.client.zrem(keys.inflight(DEFAULT_MODEL), "someone-else")  # it just ended
            await backend.admit()
            return backend.snapshot.outstanding

    assert asyncio.run(scenario()) == 1  # admitted though the snapshot still counted the bound


def test_a_submission_beyond_the_in_flight_bound_is_refused(server: RedisServer):
    """The early check reads a snapshot a second old; the submission keeps the bound exactly."""

    async def scenario() -> list:
        async with bound_to_one(server) as backend:
            await backend.admit()  # the snapshot counts nothing yet
            server.client.zadd(keys.inflight(DEFAULT_MODEL), {"someone-else": time.time() + 60})
            return [event async for event in backend.infer(request("req-over"))]

    received = asyncio.run(scenario())
    assert len(received) == 1 and isinstance(received[0], Error)
    assert received[0].kind == "rate_limited" and "the limit is 1" in received[0].message
    assert server.client.zrange(keys.inflight(DEFAULT_MODEL), 0, -1) == ["someone-else"]
    assert not server.client.keys(f"{keys.queue_name(DEFAULT_MODEL)}*")  # nothing queued


def test_admission_waits_for_a_worker_then_refuses(server: RedisServer):
    GhostWorker(server.client, "fake").leave()

    async def scenario() -> tuple[ApiError, float]:
        backend = DistributedBackend(server.url, SPEC, settings(server, queue_timeout_s=0.5))
        await backend.start()
        try:
            begun = time.monotonic()
            with pytest.raises(ApiError) as refused:
                await backend.admit()
            return refused.value, time.monotonic() - begun
        finally:
            await backend.stop()

    refused, waited = asyncio.run(scenario())
    assert refused.status == 503 and "Retry-After" in (refused.headers or {})
    assert 0.5 <= waited < 2


def test_context_length_and_load_follow_the_heartbeats(server: RedisServer):
    fake_worker(server, "other", max_model_len=256, running=2, kv_blocks_used=7)

    async def scenario() -> tuple[int, int, int]:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            while len(backend.snapshot.workers) < 2:
                await asyncio.sleep(0.05)
            running = fleet_load(backend.snapshot).running
            return backend.models()[0].context_length, running, len(backend.snapshot.live)
        finally:
            await backend.stop()

    assert asyncio.run(scenario()) == (256, 2, 2)


def test_every_error_kind_has_one_status():
    assert {kind: status.status for kind, status in ERROR_STATUSES.items()} == {
        "invalid_request": 400,
        "rate_limited": 429,
        "overloaded": 503,
        "unavailable": 503,
        "queue_timeout": 503,
        "first_token_timeout": 504,
        "total_timeout": 504,
    }
    assert api_error("queue_timeout", "late").headers == {"Retry-After": "5"}
    assert api_error("something new", "boom").status == 500


def test_a_worker_error_reaches_the_client(server: RedisServer):
    async def scenario() -> list:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            events = backend.infer(request("req-bad"))
            first = asyncio.ensure_future(anext(events))
            await asyncio.to_thread(take_job, server)
            write(
                server, "req-bad", Error("req-bad", "too long for this worker", "invalid_request")
            )
            return [await first] + [event async for event in events]
        finally:
            await backend.stop()

    assert asyncio.run(scenario()) == [
        Error("req-bad", "too long for this worker", "invalid_request")
    ]


def test_redis_unreachable_at_submission_is_a_clean_error(server: RedisServer):
    async def scenario() -> list:
        backend = await started(DistributedBackend(server.url, SPEC, settings(server)))
        try:
            server.kill()
            return [event async for event in backend.infer(request("req-down"))]
        finally:
            await backend.stop()
            server.start()

    received = asyncio.run(scenario())
    assert len(received) == 1 and isinstance(received[0], Error)
    assert received[0].kind == "unavailable"
