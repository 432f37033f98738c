"""Jobs in Redis: shared by every API replica and kept across API restarts.

Keys (all under ``sluice:job``), each expiring with the job's retention:

- ``sluice:job:<id>`` — hash: ``record`` (the submitted record as JSON) and
  the fields the runner changes (``status``, ``started_at``, ``finished_at``,
  ``usage``, ``result``, ``error``).
- ``sluice:job:<id>:events`` — stream of protocol chunks. Chunk ``n`` has the
  explicit entry id ``n-0`` (its SSE id is ``n``), so Redis itself refuses a
  second write of the same chunk. ``finish`` appends an ``end`` entry whose id,
  ``END_ID``, is above every event cursor (``api.cursors.MAX_EVENT``): after
  it no chunk can be appended, and a reader from any cursor stops there.
- ``sluice:job:<id>:runner`` — the runner lease: the holder's id, with a short
  TTL its runner keeps renewing. A lapsed lease on an unfinished job means
  its runner is gone, and any replica may adopt the job.
- ``sluice:job:<id>:tombstone`` — the record's identity with status
  ``expired``, kept ``tombstone_s`` longer than the record.
- ``sluice:jobs`` (sorted set by submission time) lists jobs;
  ``sluice:jobs:active`` (set) holds the unfinished ones, for adoption.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis

from api.cursors import MAX_EVENT
from api.jobs.records import JobOutcome, JobRecord, JobStatus, StoredChunk
from api.jobs.store import DEFAULT_RETENTION_S, JobEnded, check_read_start
from shared import keys, lua

LEASE_TTL_S = 10.0  # a runner renews its lease every LEASE_TTL_S / 3
END_ID = f"{MAX_EVENT + 1}-0"  # the end entry's: after any chunk and any cursor
READ_BLOCK_MS = 5000
LIST_BATCH = 100
INDEX = keys.JOB_INDEX
ACTIVE = keys.JOB_ACTIVE
_MUTABLE = ("started_at", "finished_at", "usage", "result", "error")

_FINISH = lua.load("api.jobs", "finish")
_APPEND = lua.load("api.jobs", "append")
_MARK_RUNNING = lua.load("api.jobs", "mark_running")
_RENEW = lua.load("api.jobs", "renew")
_RELEASE = lua.load("api.jobs", "release")


class RedisJobStore:
    """The shared store; see the module docstring for the keys and ``JobStore`` for the rules."""

    shared = True

    def __init__(
        self,
        redis_url: str,
        retention_s: float = DEFAULT_RETENTION_S,
        *,
        tombstone_s: float | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        self.retention_s = retention_s
        self.tombstone_s = retention_s if tombstone_s is None else tombstone_s
        self.lease_ttl_s = lease_ttl_s
        options: dict[str, Any] = {"decode_responses": True, "socket_connect_timeout": 2}
        self._redis = Redis.from_url(redis_url, socket_timeout=5, **options)
        # Live readers block in XREAD; they get connections with a longer timeout.
        self._blocking = Redis.from_url(
            redis_url, socket_timeout=READ_BLOCK_MS / 1000 + 5, **options
        )
        self._append = _APPEND.bind(self._redis)
        self._finish = _FINISH.bind(self._redis)
        self._mark_running = _MARK_RUNNING.bind(self._redis)
        self._renew = _RENEW.bind(self._redis)
        self._release = _RELEASE.bind(self._redis)

    @property
    def client(self) -> Redis:
        return self._redis

    async def create(self, record: JobRecord, holder: str) -> None:
        job_id, expires_ms = record.id, _ms(record.expires_at)
        tombstone = json.dumps(record.tombstone().to_dict())
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                keys.job_record(job_id),
                mapping={
                    "record": json.dumps(record.to_dict()),
                    "status": record.status.value,
                    "expires_ms": expires_ms,
                },
            )
            pipe.pexpireat(keys.job_record(job_id), expires_ms)
            pipe.set(keys.job_tombstone(job_id), tombstone, pxat=expires_ms + _ms(self.tombstone_s))
            pipe.zadd(INDEX, {job_id: record.created_at})
            pipe.sadd(ACTIVE, job_id)
            pipe.set(keys.job_runner(job_id), holder, px=_ms(self.lease_ttl_s))
            await pipe.execute()

    async def get(self, job_id: str) -> JobRecord | None:
        return (await self._get_many([job_id]))[0]

    async def list(
        self, *, owner: str | None, status: JobStatus | None, limit: int, after: str | None
    ) -> tuple[list[JobRecord], bool]:
        await self._redis.zremrangebyscore(INDEX, "-inf", time.time() - self._kept_s)
        start = 0
        if after is not None:
            rank = await self._redis.zrevrank(INDEX, after)
            if rank is None:
                return [], False
            start = rank + 1
        found: list[JobRecord] = []
        while len(found) <= limit:
            ids = await self._redis.zrevrange(INDEX, start, start + LIST_BATCH - 1)
            if not ids:
                break
            start += len(ids)
            for record in await self._get_many(ids):
                if record is None or not record.visible_to(owner):
                    continue
                if status is None or record.status == status:
                    found.append(record)
        return found[:limit], len(found) > limit

    async def mark_running(self, job_id: str, started_at: float) -> bool:
        done = await self._mark_running(
            keys=[keys.job_record(job_id)], args=[json.dumps(started_at)]
        )
        return bool(done)

    async def delete(self, job_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(
                keys.job_record(job_id),
                keys.job_events(job_id),
                keys.job_runner(job_id),
                keys.job_tombstone(job_id),
            )
            pipe.zrem(INDEX, job_id)
            pipe.srem(ACTIVE, job_id)
            await pipe.execute()

    async def finish(self, job_id: str, outcome: JobOutcome) -> bool:
        fields = {
            "finished_at": outcome.finished_at,
            "usage": outcome.usage,
            "result": outcome.result,
            "error": outcome.error,
        }
        args: list[Any] = [job_id, outcome.status.value, END_ID]
        for name, value in fields.items():
            args += [name, json.dumps(value)]
        done = await self._finish(
            keys=[keys.job_record(job_id), keys.job_events(job_id), ACTIVE], args=args
        )
        return bool(done)

    async def append(self, job_id: str, first: int, chunks: Sequence[StoredChunk]) -> None:
        args: list[Any] = [first]
        for chunk in chunks:
            args += [chunk.data, chunk.event or ""]
        if not await self._append(
            keys=[keys.job_record(job_id), keys.job_events(job_id)], args=args
        ):
            raise JobEnded(job_id)

    async def chunk_count(self, job_id: str) -> int:
        last = await self._redis.xrevrange(keys.job_events(job_id), count=1)
        if not last:
            return 0
        entry_id, fields = last[0]
        if "end" in fields:  # an ended job: count the chunks before the end entry
            return await self._redis.xlen(keys.job_events(job_id)) - 1
        return int(entry_id.split("-")[0])

    async def read(self, job_id: str, after: int) -> AsyncIterator[tuple[int, StoredChunk]]:
        check_read_start(after)
        key, last = keys.job_events(job_id), f"{after}-0"
        while await self._redis.exists(keys.job_record(job_id)):  # until it expires, at the latest
            reply = await self._blocking.xread({key: last}, count=256, block=READ_BLOCK_MS)
            if not reply and await self._ended(job_id):
                # An end this read cannot see (an older stream's, before the cursor): what was
                # written after the cursor before it, then stop.
                reply = await self._redis.xread({key: last}, count=256)
                if not reply:
                    return
            if not reply:
                continue
            for entry_id, fields in reply[0][1]:
                if "end" in fields:
                    return
                last = entry_id
                yield int(entry_id.split("-")[0]), StoredChunk(fields["d"], fields.get("e"))

    async def _ended(self, job_id: str) -> bool:
        status = await self._redis.hget(keys.job_record(job_id), "status")
        return status is not None and JobStatus(status).terminal

    async def claim(self, job_id: str, holder: str) -> bool:
        return bool(
            await self._redis.set(
                keys.job_runner(job_id), holder, nx=True, px=_ms(self.lease_ttl_s)
            )
        )

    async def renew(self, job_ids: Iterable[str], holder: str) -> set[str]:
        ids = list(job_ids)
        if not ids:
            return set()
        held = await self._renew(
            keys=[keys.job_runner(i) for i in ids], args=[holder, _ms(self.lease_ttl_s)]
        )
        return {job_id for job_id, flag in zip(ids, held, strict=True) if flag}

    async def release(self, job_id: str, holder: str) -> None:
        await self._release(keys=[keys.job_runner(job_id)], args=[holder])

    async def unfinished(self) -> list[str]:
        """Unfinished ids; expired ones found on the way leave the set."""
        ids = sorted(await self._redis.smembers(ACTIVE))
        if not ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.exists(keys.job_record(job_id))
            alive = await pipe.execute()
        gone = [job_id for job_id, exists in zip(ids, alive, strict=True) if not exists]
        if gone:
            await self._redis.srem(ACTIVE, *gone)
        return [job_id for job_id, exists in zip(ids, alive, strict=True) if exists]

    async def close(self) -> None:
        await self._blocking.aclose()
        await self._redis.aclose()

    @property
    def _kept_s(self) -> float:
        return self.retention_s + self.tombstone_s

    async def _get_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(keys.job_record(job_id))
                pipe.get(keys.job_tombstone(job_id))
            replies = await pipe.execute()
        pairs = zip(replies[::2], replies[1::2], strict=True)
        return [_record(fields, tombstone) for fields, tombstone in pairs]


def _record(fields: dict[str, str], tombstone: str | None) -> JobRecord | None:
    """A record from its hash (the static JSON plus what changed), or its tombstone."""
    if "record" not in fields:
        return JobRecord.from_dict(json.loads(tombstone)) if tombstone else None
    data = json.loads(fields["record"])
    data["status"] = fields["status"]
    for name in _MUTABLE:
        if name in fields:
            data[name] = json.loads(fields[name])
    return JobRecord.from_dict(data)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


__all__ = ["LEASE_TTL_S", "RedisJobStore"]
