"""``RequestQueue`` writes what Celery itself would, within the model's bound.

The message is compared with the one ``Celery.send_task`` puts on the same
Redis, so a kombu or Celery upgrade that changes the envelope fails here
rather than in a worker that silently drops the job. That workers run these
messages is what every other test of this package exercises.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import UTC, datetime

import pytest
from celery import Celery
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from api.backends.placement import Placement
from api.backends.request_queue import SEND_TIMEOUT_S, RequestQueue, Submission, withdraw
from api.rate_limits import KeyLimits, KeyShare
from shared import keys
from shared.sampling import SamplingParams
from shared.task_message import REQUEST_HEADER, request_header
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, decode_queued, encode_queued
from tests.distributed.conftest import RedisServer
from tests.servers import free_port

pytestmark = pytest.mark.distributed

MODEL = "job-queue-test"


def job(request_id: str, priority: int = 0) -> QueuedRequest:
    request = PreparedRequest(
        request_id, MODEL, [1, 2, 3], SamplingParams(max_tokens=4), priority=priority
    )
    now = time.time()
    return QueuedRequest(request, Deadlines(queue=now + 30, total=now + 600))


def only_message(server: RedisServer) -> tuple[str, dict]:
    (name,) = [k for k in server.client.keys(f"{keys.queue_name(MODEL)}*") if "binding" not in k]
    (raw,) = server.client.lrange(name, 0, -1)
    server.client.delete(name)
    return name, json.loads(raw)


def put(server: RedisServer, *jobs: QueuedRequest) -> None:
    async def main() -> None:
        client = Redis.from_url(server.url, decode_responses=True)
        queue = RequestQueue(client)
        await asyncio.gather(*(queue.put(j, j.deadlines.total) for j in jobs))
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("priority", [0, 2, 3, 5, 9])
def test_message_matches_celery_send_task(redis_server: RedisServer, priority: int) -> None:
    ours_job, theirs_job = job("ours", priority), job("theirs", priority)
    put(redis_server, ours_job)
    our_list, ours = only_message(redis_server)
    redis_server.client.delete(keys.inflight(MODEL))

    app = Celery("reference", broker=redis_server.url, set_as_current=False)
    app.send_task(
        keys.TASK_NAME,
        args=[encode_queued(theirs_job)],
        queue=keys.queue_name(MODEL),
        priority=priority,
        expires=datetime.fromtimestamp(theirs_job.deadlines.queue, UTC),
        headers={REQUEST_HEADER: request_header(theirs_job)},
    )
    app.close()
    their_list, theirs = only_message(redis_server)

    assert our_list == their_list  # the same priority list of the same queue
    assert ours.keys() == theirs.keys()
    assert ours["headers"].keys() == theirs["headers"].keys()
    assert ours["headers"]["task"] == keys.TASK_NAME
    assert ours["headers"][REQUEST_HEADER] == [ours_job.request.request_id, ours_job.origin or ""]
    assert set(theirs["properties"]) - set(ours["properties"]) <= {"expiration"}
    for name in ("delivery_info", "priority", "body_encoding", "delivery_mode"):
        assert ours["properties"][name] == theirs["properties"][name], name
    (args, kwargs, embed) = json.loads(base64.b64decode(ours["body"]))
    assert decode_queued(args[0]) == ours_job and kwargs == {}
    assert embed.keys() == json.loads(base64.b64decode(theirs["body"]))[2].keys()


def test_a_burst_is_queued_with_its_in_flight_entries(redis_server: RedisServer) -> None:
    jobs = [job(f"burst-{i}") for i in range(40)]
    put(redis_server, *jobs)

    queued = redis_server.client.lrange(keys.queue_name(MODEL), 0, -1)
    bodies = [json.loads(base64.b64decode(json.loads(raw)["body"])) for raw in queued]
    ids = {decode_queued(body[0][0]).request.request_id for body in bodies}
    assert ids == {j.request.request_id for j in jobs}
    inflight = redis_server.client.zrange(keys.inflight(MODEL), 0, -1, withscores=True)
    assert dict(inflight) == {j.request.request_id: j.deadlines.total for j in jobs}
    redis_server.client.delete(keys.queue_name(MODEL), keys.inflight(MODEL))


def put_bounded(url: str, bound: int | None, *jobs: QueuedRequest) -> list[bool]:
    """Each job through one of two ``RequestQueue``s, clients of their own: two API processes."""

    async def main() -> list[bool]:
        clients = [Redis.from_url(url, decode_responses=True) for _ in range(2)]
        queues = [RequestQueue(client) for client in clients]
        puts = (queues[i % 2].put(j, j.deadlines.total, bound) for i, j in enumerate(jobs))
        results = await asyncio.gather(*puts)
        for client in clients:
            await client.aclose()
        return [submission.message is not None for submission in results]

    return asyncio.run(main())


def test_two_processes_share_the_bound_without_overshoot(redis_server: RedisServer) -> None:
    client, inflight = redis_server.client, keys.inflight(MODEL)
    client.zadd(inflight, {"running-1": time.time() + 600, "running-2": time.time() + 600})
    client.zadd(inflight, {"crashed-long-ago": time.time() - 5})  # no longer counts
    jobs = [job(f"bounded-{i}") for i in range(10)]

    queued = put_bounded(redis_server.url, 5, *jobs)

    assert queued.count(True) == 3  # 2 running + 3 = the bound of 5
    accepted = {j.request.request_id for j, ok in zip(jobs, queued, strict=True) if ok}
    assert len(client.lrange(keys.queue_name(MODEL), 0, -1)) == 3
    assert client.zcount(inflight, time.time(), "+inf") == 5
    assert accepted <= set(client.zrange(inflight, 0, -1))
    client.delete(keys.queue_name(MODEL), inflight)


def test_a_key_s_share_is_taken_in_the_submission_after_the_bound(
    redis_server: RedisServer,
) -> None:
    """Two processes, one key of three requests a minute and two at once, a bound of four."""
    client, inflight = redis_server.client, keys.inflight(MODEL)
    limits = KeyLimits(requests_per_minute=3, max_concurrent=2)
    share = KeyShare(f"share-{time.time_ns()}", limits, 10)

    async def main() -> list[Submission]:
        clients = [Redis.from_url(redis_server.url, decode_responses=True) for _ in range(2)]
        queues = [RequestQueue(c) for c in clients]
        jobs = [job(f"shared-{i}") for i in range(5)]
        # One after another, so the order of verdicts is known.
        results = [await queues[i % 2].put(j, j.deadlines.total, 4, share=share)
                   for i, j in enumerate(jobs)]  # fmt: skip
        for c in clients:
            await c.aclose()
        return results

    results = asyncio.run(main())
    verdicts = [r.verdict for r in results]
    assert [r.message is not None for r in results] == [True, True, False, False, False]
    assert all(v is not None for v in verdicts)
    assert [v.allowed for v in verdicts] == [True, True, False, False, False]  # type: ignore[union-attr]
    assert "2 requests at once" in verdicts[2].reason  # type: ignore[union-attr]
    assert verdicts[1].remaining_requests == pytest.approx(1, abs=0.05)  # type: ignore[union-attr]
    assert client.zcard(inflight) == 2 and client.get(keys.rate_running(share.key)) == "2"
    # The bound refuses before the key is asked: its share is not taken.
    client.zadd(inflight, {f"running-{i}": time.time() + 600 for i in range(2)})
    refused = asyncio.run(_put_one(redis_server.url, job("over-the-bound"), 4, share))
    assert refused.message is None and refused.verdict is None
    assert client.get(keys.rate_running(share.key)) == "2"
    client.delete(keys.queue_name(MODEL), inflight)


async def _put_one(url: str, one: QueuedRequest, bound: int, share: KeyShare) -> Submission:
    client = Redis.from_url(url, decode_responses=True)
    try:
        return await RequestQueue(client).put(one, one.deadlines.total, bound, share=share)
    finally:
        await client.aclose()


def test_without_a_bound_nothing_is_refused(redis_server: RedisServer) -> None:
    """Async jobs: refused, if at all, before they were accepted."""
    client, inflight = redis_server.client, keys.inflight(MODEL)
    client.zadd(inflight, {f"running-{i}": time.time() + 600 for i in range(5)})

    assert put_bounded(redis_server.url, None, job("a-job"), job("another")) == [True, True]
    assert client.zcard(inflight) == 7
    client.delete(keys.queue_name(MODEL), inflight)


def test_an_unreachable_redis_fails_every_waiter() -> None:
    async def main() -> list[BaseException | None]:
        client = Redis(port=free_port(), socket_connect_timeout=1)
        queue = RequestQueue(client)
        jobs = [job(f"lost-{i}") for i in range(3)]
        results = await asyncio.gather(
            *(queue.put(j, j.deadlines.total) for j in jobs), return_exceptions=True
        )
        await client.aclose()
        return results

    started = time.monotonic()
    results = asyncio.run(main())
    assert all(isinstance(result, RedisConnectionError | OSError) for result in results), results
    # redis-py retries a refused connection 10 times, with jittered backoff (up to ~5 s in all)
    assert time.monotonic() - started < SEND_TIMEOUT_S + 1


def test_a_placed_job_is_withdrawn_from_its_own_queue_or_the_shared_one(
    redis_server: RedisServer,
) -> None:
    """Cancelled before any worker took it: found where it waits, handed back or not."""
    client = redis_server.client
    placement = Placement("prefix", keys.own_queue(MODEL, "w"), "w", 32, time.time() + 2)
    shared_wake = keys.queue_wake(keys.queue_name(MODEL))
    tokens = client.llen(shared_wake)  # other tests' jobs may have left some

    async def put_and_withdraw(move: bool) -> tuple[str, str, str]:
        redis = Redis.from_url(redis_server.url, decode_responses=True)
        try:
            submission = await RequestQueue(redis).put(
                job(f"placed-{move}"), time.time() + 600, placement=placement
            )
            message = submission.message
            assert message is not None and message.key == placement.queue
            assert client.lrange(message.key, 0, -1) == [message.body]
            if move:  # as the worker's heartbeat hands it back
                client.lmove(message.key, message.shared_key, "RIGHT", "RIGHT")
                client.lmove(message.wake, message.shared_wake, "RIGHT", "RIGHT")
            async with redis.pipeline(transaction=False) as pipe:
                await withdraw(pipe, message)
                (removed,) = await pipe.execute()
            assert removed == 1
            return message.key, message.shared_key, message.body
        finally:
            await redis.aclose()

    for move in (False, True):
        own, shared, body = asyncio.run(put_and_withdraw(move))
        assert not client.exists(own, keys.queue_wake(placement.queue))
        assert body not in client.lrange(shared, 0, -1) and client.llen(shared_wake) == tokens
    client.delete(keys.inflight(MODEL))
