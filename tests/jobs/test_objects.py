"""The object store contract (files and batches), for the in-memory store and the Redis one.

Every test runs against both: each owner's index and quota counters, the
counters kept right by every write, deletion and expiry however many objects
an owner holds, a quota that cannot be walked around, and listing by cursor
in either order. The Redis store also keeps one owner's cost off another's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from api.batches.files import Files
from api.batches.objects import MemoryObjects, ObjectStore, Quota, QuotaExceeded, RedisObjects
from api.errors import ApiError

pytestmark = pytest.mark.anyio

KIND = "file"


@pytest.fixture(params=["memory", "redis"])
async def objects(request: pytest.FixtureRequest) -> AsyncIterator[ObjectStore]:
    if request.param == "memory":
        yield MemoryObjects()
        return
    url = request.getfixturevalue("redis_url")
    await Redis.from_url(url).flushdb()
    store = RedisObjects(url)
    try:
        yield store
    finally:
        await store.close()


def record(object_id: str, owner: str | None, *, at: float = 0.0, kept_s: float = 3600.0):
    now = time.time()
    return {"id": object_id, "owner": owner, "created_at": at or now, "kept_until": now + kept_s}


def files(objects: ObjectStore, *, per_key_bytes: int = 100, per_key_files: int = 20) -> Files:
    return Files(
        objects,
        max_file_bytes=50,
        max_bytes_per_key=per_key_bytes,
        max_files_per_key=per_key_files,
        default_expiry_s=3600,
        body_timeout_s=5,
    )


async def test_charged_writes_are_counted_and_refused_past_the_quota(objects: ObjectStore):
    quota = Quota(bytes=10, count=3)
    await objects.put(KIND, "a", record("a", "alice"), b"12345", quota)
    await objects.put(KIND, "b", record("b", "alice"), b"1234", quota)
    assert await objects.held(KIND, "alice") == (9, 2)
    with pytest.raises(QuotaExceeded) as over:
        await objects.put(KIND, "c", record("c", "alice"), b"12", quota)
    assert (over.value.held_bytes, over.value.held_count, over.value.size) == (9, 2, 2)
    assert await objects.get(KIND, "c") is None  # nothing was written
    await objects.put(KIND, "c", record("c", "alice"), b"1", quota)
    with pytest.raises(QuotaExceeded):  # the count: an empty one does not fit either
        await objects.put(KIND, "d", record("d", "alice"), b"", quota)
    await objects.put(KIND, "e", record("e", "bob"), b"1234567890", quota)  # bob's own
    await objects.put(KIND, "f", record("f", "alice"), b"0" * 99)  # not charged
    assert await objects.held(KIND, "alice") == (10, 3)
    assert await objects.delete(KIND, "a")
    assert not await objects.delete(KIND, "a")
    assert await objects.held(KIND, "alice") == (5, 2)


async def test_expired_objects_give_their_charge_back(objects: ObjectStore):
    quota = Quota(bytes=10, count=2)
    await objects.put(KIND, "a", record("a", "alice", kept_s=0.3), b"12345", quota)
    await objects.put(KIND, "b", record("b", "alice"), b"12345", quota)
    with pytest.raises(QuotaExceeded):
        await objects.put(KIND, "c", record("c", "alice"), b"1", quota)
    time.sleep(0.5)
    assert await objects.get(KIND, "a") is None
    assert await objects.held(KIND, "alice") == (5, 1)
    await objects.put(KIND, "c", record("c", "alice"), b"12345", quota)
    listed, _ = await objects.list(KIND, "alice", 10, None)
    assert [r["id"] for r in listed] == ["c", "b"]


async def test_the_quota_holds_past_ten_thousand_files(objects: ObjectStore):
    """Summing a listing of the newest 10,000 once let a key free its quota with empty files."""
    quota = Quota(bytes=100, count=20_000)
    await objects.put(KIND, "full", record("full", "alice", at=1.0), b"0" * 100, quota)
    for n in range(10_001):
        await objects.put(KIND, f"e{n}", record(f"e{n}", "alice", at=2.0 + n), b"", quota)
    assert await objects.held(KIND, "alice") == (100, 10_002)
    with pytest.raises(QuotaExceeded):
        await objects.put(KIND, "more", record("more", "alice"), b"1", quota)


async def test_the_files_api_counts_bytes_and_files_per_key(objects: ObjectStore):
    store = files(objects, per_key_bytes=100, per_key_files=3)
    await store.create(b"0" * 50, "a.jsonl", "batch", "alice")
    with pytest.raises(ApiError) as too_big:
        await store.create(b"0" * 51, "b.jsonl", "batch", "alice")
    assert too_big.value.status == 413 and "--max-file-bytes" in too_big.value.message
    await store.create(b"0" * 50, "b.jsonl", "batch", "alice")
    with pytest.raises(ApiError) as over_bytes:
        await store.create(b"0", "c.jsonl", "batch", "alice")
    assert "--max-file-bytes-per-key" in over_bytes.value.message
    output = await store.create(b"0" * 500, "out.jsonl", "batch_output", "alice", charged=False)
    await store.create(b"", "c.jsonl", "batch", "bob")
    first = await store.create(b"", "d.jsonl", "batch", "carol")
    await store.create(b"", "e.jsonl", "batch", "carol")
    await store.create(b"", "f.jsonl", "batch", "carol")
    with pytest.raises(ApiError) as over_count:
        await store.create(b"", "g.jsonl", "batch", "carol")
    assert over_count.value.status == 413 and "--max-files-per-key" in over_count.value.message
    await store.delete(first["id"], "carol")
    await store.create(b"", "g.jsonl", "batch", "carol")  # a deletion gives its place back
    assert await objects.held(KIND, "alice") == (100, 2)  # the output is not charged
    await store.delete(output["id"], "alice")
    assert await objects.held(KIND, "alice") == (100, 2)


async def test_a_record_read_or_written_is_a_snapshot(objects: ObjectStore):
    """A runner changing its copy in place changes nothing a reader sees until it writes."""
    saved = {**record("a", "alice"), "counts": {"errored": 0}}
    await objects.put(KIND, "a", saved)
    saved["counts"]["errored"] += 1
    read = await objects.get(KIND, "a")
    assert read is not None and read["counts"] == {"errored": 0}
    read["counts"]["errored"] = 9
    assert (await objects.get(KIND, "a"))["counts"] == {"errored": 0}
    await objects.update(KIND, "a", saved)
    saved["counts"]["errored"] += 1
    assert (await objects.get(KIND, "a"))["counts"] == {"errored": 1}


async def test_listing_pages_by_cursor_in_either_order_with_a_filter(objects: ObjectStore):
    for n in range(7):
        await objects.put(KIND, f"f{n}", {**record(f"f{n}", "alice", at=1.0 + n), "n": n})
    await objects.put(KIND, "other", record("other", "bob", at=100.0))

    def ids(records: list[dict[str, Any]]) -> list[str]:
        return [r["id"] for r in records]

    page, more = await objects.list(KIND, "alice", 3, None)
    assert (ids(page), more) == (["f6", "f5", "f4"], True)
    page, more = await objects.list(KIND, "alice", 3, "f4")
    assert (ids(page), more) == (["f3", "f2", "f1"], True)
    page, more = await objects.list(KIND, "alice", 3, "f1")
    assert (ids(page), more) == (["f0"], False)
    page, more = await objects.list(KIND, "alice", 2, "f2", ascending=True)
    assert (ids(page), more) == (["f3", "f4"], True)
    even = await objects.list(KIND, "alice", 10, None, where=lambda r: r["n"] % 2 == 0)
    assert ids(even[0]) == ["f6", "f4", "f2", "f0"]
    assert await objects.list(KIND, "alice", 3, "unknown") == ([], False)
    assert ids((await objects.list(KIND, "bob", 10, None))[0]) == ["other"]


async def test_one_owner_s_files_cost_nothing_to_another_s_calls(redis_url: str):
    """Listing and uploading read the caller's own index and counters, not every key's."""
    client = Redis.from_url(redis_url)
    await client.flushdb()
    objects = RedisObjects(redis_url)
    try:
        for n in range(2_000):
            await objects.put(KIND, f"a{n}", record(f"a{n}", "alice"), b"x", Quota(10**6, 10**6))
        await objects.put(KIND, "b0", record("b0", "bob"), b"x", Quota(10**6, 10**6))
        await client.config_resetstat()
        store = files(objects, per_key_bytes=10**6, per_key_files=10**6)
        await store.create(b"y", "b.jsonl", "batch", "bob")
        page, _ = await objects.list(KIND, "bob", 20, None)
        assert len(page) == 2
        stats = await client.info("commandstats")
        calls = sum(int(value["calls"]) for value in stats.values())
        assert calls < 20, stats  # a handful of commands, whatever alice holds
    finally:
        await objects.close()
        await client.aclose()
