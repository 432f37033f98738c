"""The store contract, for the in-memory store and the Redis one alike.

Every test runs against both: chunk numbering and exactly-once writes, the
end of the stream at ``finish``, live readers, listing, retention with its
tombstone, and (Redis) the runner leases that adoption relies on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import anyio
import pytest

from api.cursors import MAX_EVENT
from api.jobs.records import JobOutcome, JobStatus, StoredChunk
from api.jobs.redis_store import RedisJobStore
from api.jobs.store import JobEnded, JobStore, MemoryJobStore
from tests.jobs.conftest import make_record

pytestmark = pytest.mark.anyio


class Clock:
    """A settable clock for the memory store's retention."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[JobStore]:
    if request.param == "memory":
        yield MemoryJobStore()
        return
    store = RedisJobStore(request.getfixturevalue("redis_url"))
    await store.client.flushdb()
    try:
        yield store
    finally:
        await store.close()


def chunk(n: int) -> StoredChunk:
    return StoredChunk(f'{{"n":{n}}}', "delta" if n % 2 else None)


async def read_all(store: JobStore, job_id: str, after: int = 0) -> list[tuple[int, StoredChunk]]:
    with anyio.fail_after(10):
        return [item async for item in store.read(job_id, after)]


async def test_a_record_round_trips_and_unknown_jobs_are_none(store: JobStore) -> None:
    record = make_record()
    await store.create(record, "holder")
    assert await store.get(record.id) == record
    assert await store.get("job_missing") is None


async def test_chunks_are_numbered_from_one_and_read_from_any_point(store: JobStore) -> None:
    record = make_record()
    await store.create(record, "holder")
    await store.append(record.id, 1, [chunk(1), chunk(2)])
    await store.append(record.id, 3, [chunk(3)])
    assert await store.chunk_count(record.id) == 3
    await store.finish(record.id, JobOutcome(JobStatus.COMPLETED))
    assert await read_all(store, record.id) == [(1, chunk(1)), (2, chunk(2)), (3, chunk(3))]
    assert await read_all(store, record.id, after=2) == [(3, chunk(3))]
    assert await store.chunk_count(record.id) == 3


async def test_a_chunk_is_written_once_and_nothing_after_the_end(store: JobStore) -> None:
    record = make_record()
    await store.create(record, "holder")
    await store.append(record.id, 1, [chunk(1)])
    with pytest.raises(JobEnded):
        await store.append(record.id, 1, [chunk(1)])  # a second runner writing the same chunk
    assert await store.finish(record.id, JobOutcome(JobStatus.CANCELLED))
    assert not await store.finish(record.id, JobOutcome(JobStatus.COMPLETED))
    with pytest.raises(JobEnded):
        await store.append(record.id, 2, [chunk(2)])
    assert (await store.get(record.id)).status is JobStatus.CANCELLED


async def test_a_read_starts_at_a_chunk_that_can_exist(store: JobStore) -> None:
    """A negative start would walk back from the end: refused before anything is read."""
    record = make_record()
    await store.create(record, "holder")
    await store.append(record.id, 1, [chunk(1), chunk(2)])
    await store.finish(record.id, JobOutcome(JobStatus.COMPLETED))
    with pytest.raises(ValueError, match="chunk 0 or later"):
        await read_all(store, record.id, after=-2)
    assert await read_all(store, record.id, after=5) == []  # past the end: nothing, at once
    assert await read_all(store, record.id, after=MAX_EVENT) == []  # past any end entry too


async def test_a_job_that_ended_with_no_chunk_reads_as_empty_at_once(store: JobStore) -> None:
    record = make_record()
    await store.create(record, "holder")
    await store.finish(record.id, JobOutcome(JobStatus.CANCELLED))
    assert await read_all(store, record.id) == []
    assert await read_all(store, record.id, after=3) == []


async def test_a_long_stored_stream_lets_the_event_loop_run_while_it_is_read(
    store: JobStore,
) -> None:
    record = make_record()
    await store.create(record, "holder")
    await store.append(record.id, 1, [chunk(n) for n in range(1, 2001)])
    await store.finish(record.id, JobOutcome(JobStatus.COMPLETED))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        assert len(await read_all(store, record.id)) == 2000
        group.cancel_scope.cancel()
    assert ticks >= 2000 // 256  # at least once per batch of chunks


async def test_status_moves_forward_only(store: JobStore) -> None:
    record = make_record()
    await store.create(record, "holder")
    assert await store.mark_running(record.id, 123.0)
    assert not await store.mark_running(record.id, 456.0)
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    outcome = JobOutcome(JobStatus.COMPLETED, usage, result={"id": "chatcmpl-1"}, finished_at=789)
    assert await store.finish(record.id, outcome)
    saved = await store.get(record.id)
    assert (saved.status, saved.started_at, saved.finished_at) == (JobStatus.COMPLETED, 123, 789)
    assert (saved.usage, saved.result) == (usage, {"id": "chatcmpl-1"})


async def test_a_live_reader_gets_chunks_as_they_come_and_stops_at_the_end(
    store: JobStore,
) -> None:
    record = make_record()
    await store.create(record, "holder")
    seen: list[int] = []

    async def reader() -> None:
        async for index, _ in store.read(record.id, 0):
            seen.append(index)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(reader)
            for n in (1, 2, 3):
                await anyio.sleep(0.05)
                await store.append(record.id, n, [chunk(n)])
            await store.finish(record.id, JobOutcome(JobStatus.COMPLETED))
    assert seen == [1, 2, 3]


async def test_a_deleted_job_is_gone_at_once_and_its_writer_stops(store: JobStore) -> None:
    record, other = make_record("job_1"), make_record("job_2")
    for job in (record, other):
        await store.create(job, "holder")
    await store.append(record.id, 1, [chunk(1)])
    await store.delete(record.id)
    assert await store.get(record.id) is None  # not even a tombstone
    assert await read_all(store, record.id) == []
    with pytest.raises(JobEnded):
        await store.append(record.id, 2, [chunk(2)])
    listed, _ = await store.list(owner=None, status=None, limit=10, after=None)
    assert [job.id for job in listed] == [other.id]
    assert record.id not in await store.unfinished()


async def test_listing_is_newest_first_filtered_and_paged(store: JobStore) -> None:
    ids = [f"job_{n}" for n in range(5)]
    for job_id in ids:
        await store.create(make_record(job_id), "holder")
        time.sleep(0.002)  # distinct submission times
    await store.create(make_record("job_other", owner="sk-other"), "holder")
    await store.finish("job_1", JobOutcome(JobStatus.COMPLETED))
    await store.finish("job_3", JobOutcome(JobStatus.COMPLETED))

    page, more = await store.list(owner="sk-me", status=None, limit=3, after=None)
    assert [r.id for r in page] == ["job_4", "job_3", "job_2"] and more
    page, more = await store.list(owner="sk-me", status=None, limit=3, after="job_2")
    assert [r.id for r in page] == ["job_1", "job_0"] and not more
    done, _ = await store.list(owner=None, status=JobStatus.COMPLETED, limit=10, after=None)
    assert [r.id for r in done] == ["job_3", "job_1"]
    everyone, _ = await store.list(owner="sk-other", status=None, limit=10, after=None)
    assert everyone[0].id == "job_other" and len(everyone) == 6
    assert sorted(await store.unfinished()) == ["job_0", "job_2", "job_4", "job_other"]


async def test_retention_leaves_a_tombstone_then_nothing() -> None:
    clock = Clock()
    store = MemoryJobStore(retention_s=60, clock=clock)
    record = make_record()
    record.created_at, record.expires_at = clock.now, clock.now + 60
    await store.create(record, "holder")
    await store.append(record.id, 1, [chunk(1)])
    clock.now += 61
    expired = await store.get(record.id)
    assert expired.status is JobStatus.EXPIRED and expired.body == {} and expired.result is None
    assert await read_all(store, record.id) == []
    with pytest.raises(JobEnded):
        await store.append(record.id, 2, [chunk(2)])
    clock.now += 60
    assert await store.get(record.id) is None


async def test_redis_retention_expires_record_and_events_together(redis_url: str) -> None:
    store = RedisJobStore(redis_url, retention_s=0.4, tombstone_s=0.4)
    try:
        record = make_record(f"job_{uuid.uuid4().hex}", retention_s=0.4)
        await store.create(record, "holder")
        await store.append(record.id, 1, [chunk(1)])
        assert (await store.get(record.id)).status is JobStatus.QUEUED
        await anyio.sleep(0.5)
        assert (await store.get(record.id)).status is JobStatus.EXPIRED
        assert await store.client.exists(f"sluice:job:{record.id}:events") == 0
        assert await read_all(store, record.id) == []
        assert record.id not in await store.unfinished()
        await anyio.sleep(0.4)
        assert await store.get(record.id) is None
    finally:
        await store.close()


async def test_redis_leases_tell_a_live_runner_from_a_gone_one(redis_url: str) -> None:
    store = RedisJobStore(redis_url, lease_ttl_s=0.3)
    try:
        record = make_record(f"job_{uuid.uuid4().hex}")
        await store.create(record, "first")
        assert not await store.claim(record.id, "second")  # its runner is alive
        assert await store.renew([record.id], "first") == {record.id}
        await anyio.sleep(0.4)  # the first runner stopped renewing: gone
        assert await store.claim(record.id, "second")
        assert await store.renew([record.id], "first") == set()
        await store.release(record.id, "first")  # not its lease any more: no effect
        assert not await store.claim(record.id, "third")
        await store.release(record.id, "second")
        assert await store.claim(record.id, "third")
    finally:
        await store.close()
