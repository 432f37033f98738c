"""Where jobs live: the store interface and the in-process store of embedded mode.

A store keeps each job's record and its event stream: the protocol chunks in
order, numbered from 1 (the number is the SSE ``id``). Two rules every store
keeps, which the runner and the readers rely on:

- Chunk ``n`` is written once. Appending an index that is taken, or
  appending after the job reached a terminal status, raises ``JobEnded``;
  that is how a runner learns the job was cancelled (or adopted) elsewhere.
- ``finish`` moves a queued or running job to its terminal status and closes
  the stream in the same step, so a reader never waits on a job that ended
  and never sees a chunk written after the end.

Retention: a job's record and events go together ``retention_s`` after
submission. For as long again a tombstone answers with status ``expired``
(identity and metadata only); after that the job is unknown (404).

``MemoryJobStore`` keeps all of this in this process: fine for the embedded
mode, which runs one process anyway, and documented as not surviving a
restart. ``api.jobs.redis_store.RedisJobStore`` is the shared one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from api.jobs.records import JobOutcome, JobRecord, JobStatus, StoredChunk

DEFAULT_RETENTION_S = 86_400.0
SWEEP_INTERVAL_S = 60.0
READ_RECHECK_S = 5.0
READ_BATCH = 256  # chunks a read hands over between two passes of the event loop


def check_read_start(after: int) -> None:
    """A read starts after a chunk that can exist: 0 (the beginning) or later.

    The routes bound their cursors (``api.cursors``); this keeps a store from
    ever walking back from the end.
    """
    if after < 0:
        raise ValueError(f"a read starts after chunk 0 or later, not {after}")


class JobEnded(Exception):
    """The job is over (or the chunk index was written by another runner): stop writing."""


class JobStore(Protocol):
    """What the routes, the runners and adoption need from a store."""

    retention_s: float  # record and events, from submission
    tombstone_s: float  # then status "expired", for this long
    shared: bool  # visible to every API process and kept across restarts: adoption applies

    async def create(self, record: JobRecord, holder: str) -> None:
        """Save a new job, its runner lease held by ``holder``."""
        ...

    async def get(self, job_id: str) -> JobRecord | None:
        """The record, its tombstone after retention, or None when unknown."""
        ...

    async def list(
        self, *, owner: str | None, status: JobStatus | None, limit: int, after: str | None
    ) -> tuple[list[JobRecord], bool]:
        """Newest first, after the job ``after`` (a cursor); and whether more follow."""
        ...

    async def mark_running(self, job_id: str, started_at: float) -> bool: ...

    async def delete(self, job_id: str) -> None:
        """Forget the job at once: record, events and tombstone (readers stop)."""
        ...

    async def finish(self, job_id: str, outcome: JobOutcome) -> bool:
        """Terminal status and outcome, stream closed; False if the job had already ended."""
        ...

    async def append(self, job_id: str, first: int, chunks: Sequence[StoredChunk]) -> None:
        """Chunks numbered ``first``, ``first + 1``, …; ``JobEnded`` if refused."""
        ...

    async def chunk_count(self, job_id: str) -> int: ...

    def read(self, job_id: str, after: int) -> AsyncIterator[tuple[int, StoredChunk]]:
        """Chunks after index ``after``, live until the job ends (or expires)."""
        ...

    async def claim(self, job_id: str, holder: str) -> bool:
        """Take the runner lease of a job whose lease lapsed."""
        ...

    async def renew(self, job_ids: Iterable[str], holder: str) -> set[str]:
        """Extend ``holder``'s leases; the ids it still holds."""
        ...

    async def release(self, job_id: str, holder: str) -> None: ...

    async def unfinished(self) -> list[str]:
        """Ids of queued and running jobs: the candidates for adoption."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Entry:
    record: JobRecord
    chunks: list[StoredChunk] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class MemoryJobStore:
    """Jobs in this process's memory: lost when it stops (embedded mode).

    One process runs every job, so leases are trivially held and nothing is
    ever adopted. ``clock`` is injectable so retention can be tested without
    waiting.
    """

    shared = False

    def __init__(
        self,
        retention_s: float = DEFAULT_RETENTION_S,
        *,
        tombstone_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention_s = retention_s
        self.tombstone_s = retention_s if tombstone_s is None else tombstone_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}  # in submission order
        self._swept = clock()

    async def create(self, record: JobRecord, holder: str) -> None:
        self._sweep()
        self._entries[record.id] = _Entry(record)

    async def get(self, job_id: str) -> JobRecord | None:
        entry = self._live(job_id)
        if entry is not None:
            return _copy(entry.record)
        stale = self._entries.get(job_id)
        return stale.record.tombstone() if stale is not None and self._kept(stale) else None

    async def list(
        self, *, owner: str | None, status: JobStatus | None, limit: int, after: str | None
    ) -> tuple[list[JobRecord], bool]:
        found: list[JobRecord] = []
        passed = after is None
        for job_id in reversed(list(self._entries)):  # newest first
            if not passed:
                passed = job_id == after
                continue
            record = await self.get(job_id)
            if record is None or not record.visible_to(owner):
                continue
            if status is None or record.status == status:
                found.append(record)
                if len(found) > limit:
                    break
        return found[:limit], len(found) > limit

    async def mark_running(self, job_id: str, started_at: float) -> bool:
        entry = self._live(job_id)
        if entry is None or entry.record.status is not JobStatus.QUEUED:
            return False
        entry.record.status, entry.record.started_at = JobStatus.RUNNING, started_at
        return True

    async def delete(self, job_id: str) -> None:
        entry = self._entries.pop(job_id, None)
        if entry is not None:
            entry.record.status = JobStatus.CANCELLED  # a reader waiting on it ends
            async with entry.changed:
                entry.changed.notify_all()

    async def finish(self, job_id: str, outcome: JobOutcome) -> bool:
        entry = self._live(job_id)
        if entry is None or entry.record.status.terminal:
            return False
        record = entry.record
        record.status, record.finished_at = outcome.status, outcome.finished_at
        record.usage, record.result, record.error = outcome.usage, outcome.result, outcome.error
        async with entry.changed:
            entry.changed.notify_all()
        return True

    async def append(self, job_id: str, first: int, chunks: Sequence[StoredChunk]) -> None:
        entry = self._live(job_id)
        if entry is None or entry.record.status.terminal or first != len(entry.chunks) + 1:
            raise JobEnded(job_id)
        entry.chunks += chunks
        async with entry.changed:
            entry.changed.notify_all()

    async def chunk_count(self, job_id: str) -> int:
        entry = self._live(job_id)
        return len(entry.chunks) if entry is not None else 0

    async def read(self, job_id: str, after: int) -> AsyncIterator[tuple[int, StoredChunk]]:
        check_read_start(after)
        while (entry := self._live(job_id)) is not None:
            async with entry.changed:
                with contextlib.suppress(TimeoutError):  # look again: the job may have expired
                    async with asyncio.timeout(READ_RECHECK_S):
                        await entry.changed.wait_for(
                            lambda e=entry, n=after: len(e.chunks) > n or e.record.status.terminal
                        )
            while after < len(entry.chunks):
                fresh = entry.chunks[after : after + READ_BATCH]
                for index, chunk in enumerate(fresh, after + 1):
                    yield index, chunk
                after += len(fresh)
                await asyncio.sleep(0)  # a long stored stream lets other requests run between
            if entry.record.status.terminal:
                return

    async def claim(self, job_id: str, holder: str) -> bool:
        return False  # the one process already runs every job it has

    async def renew(self, job_ids: Iterable[str], holder: str) -> set[str]:
        return set(job_ids)

    async def release(self, job_id: str, holder: str) -> None:
        return None

    async def unfinished(self) -> list[str]:
        return [i for i, e in self._entries.items() if not e.record.status.terminal]

    async def close(self) -> None:
        return None

    def _live(self, job_id: str) -> _Entry | None:
        """The entry while its retention lasts."""
        entry = self._entries.get(job_id)
        return entry if entry is not None and self._clock() < entry.record.expires_at else None

    def _kept(self, entry: _Entry) -> bool:
        return self._clock() < entry.record.expires_at + self.tombstone_s

    def _sweep(self) -> None:
        """Forget jobs past their tombstone, at most once a minute."""
        now = self._clock()
        if now - self._swept < SWEEP_INTERVAL_S:
            return
        self._swept = now
        for job_id in [i for i, e in self._entries.items() if not self._kept(e)]:
            del self._entries[job_id]


def _copy(record: JobRecord) -> JobRecord:
    """A snapshot, so a caller never sees a record change under it."""
    return JobRecord.from_dict(record.to_dict())


__all__ = [
    "DEFAULT_RETENTION_S",
    "JobEnded",
    "JobStore",
    "MemoryJobStore",
    "check_read_start",
]
