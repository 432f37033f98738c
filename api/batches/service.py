"""Batches: many requests, each run as an async job, their outcomes gathered at the end.

A batch is a record (``api.batches.objects``, kind ``batch``) with its lines
(custom id, endpoint, body) as its blob. Its runner submits the lines as jobs
in order, at most ``window`` unfinished at once and at ``BATCH_PRIORITY``, so
a batch never crowds out interactive requests: the queue and the engine serve
more urgent work first. A line the endpoint refuses (a 400) fails that line
only; a refusal that says when to retry (``Retry-After``: the key's rate limits,
a full server) is retried then, and a line whose job was lost or failed in a way
that says to retry later is queued again.

Line ``i``'s job id is the batch's random part followed by ``i`` (and, for a
line queued again, its attempt, kept in the record), so the lines' jobs can be
found again: when the replica running a batch stops, its
lease lapses and another replica (its periodic scan) takes the batch over,
skips the lines whose jobs exist (the job machinery adopts those) and goes
on. Outcomes are read from the jobs' records once every line has ended, in
line order, so an output holds each line exactly once whoever wrote it.

The record's ``status`` follows OpenAI's words (``in_progress``,
``finalizing``, ``completed``, ``cancelling``, ``cancelled``, ``failed``,
``expired``); ``counts`` has Anthropic's (``processing``, ``succeeded``,
``errored``, ``canceled``, ``expired``). Each protocol's routes render them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI

from api.batches.objects import ObjectStore, visible
from api.errors import ApiError, bad_request
from api.jobs.manager import JobManager, JobRequest, SubmitError
from api.jobs.records import JobRecord, JobStatus
from api.store_errors import store_errors

if TYPE_CHECKING:
    from api.auth import KeyRing

log = logging.getLogger(__name__)
T = TypeVar("T")

KIND = "batch"
CANCEL_KIND = "batch_cancel"
BATCH_PRIORITY = 6  # kombu's third priority step: interactive requests (0) go first
POLL_S = 0.25
LINES_PER_PASS = 256  # outcomes gathered between two passes of the event loop
STORE_RETRY_S = 1.0  # the pause before a step the store failed is tried again
LEASE_TTL_S = 10.0
ENDED = ("completed", "cancelled", "failed", "expired")


@dataclass(slots=True)
class Line:
    custom_id: str
    endpoint: str  # a protocol path
    body: dict[str, Any]


@dataclass(slots=True)
class Outcome:
    """How one line ended: Anthropic's result kinds, the HTTP status and body it got."""

    custom_id: str
    kind: str  # succeeded | errored | canceled | expired
    response_id: str | None = None
    status_code: int | None = None
    body: dict[str, Any] | None = None


# Writes a batch's outputs from its outcomes, given in order a part at a time; returns the
# fields to add to its record.
Finalizer = Callable[[dict[str, Any], AsyncIterator[list[Outcome]]], Awaitable[dict[str, Any]]]


class Batches:
    """Creates, runs, takes over and cancels batches; one per API process."""

    def __init__(
        self,
        manager: JobManager,
        objects: ObjectStore,
        keys: KeyRing,
        finalizers: dict[str, Finalizer],
        window: int,
        retention_s: float,
    ) -> None:
        self.manager = manager
        self.objects = objects
        self.keys = keys
        self.finalizers = finalizers  # by the record's "api"
        self.window = window
        self.retention_s = retention_s
        self._running: dict[str, asyncio.Task[None]] = {}
        self._maintainer: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self.objects.shared:
            self._maintainer = asyncio.create_task(self._maintain(), name="sluice-batches")
        try:
            yield
        finally:
            if self._maintainer is not None:
                self._maintainer.cancel()
            for task in list(self._running.values()):
                task.cancel()
            await self.objects.close()

    async def create(self, record: dict[str, Any], lines: list[Line]) -> dict[str, Any]:
        """Save the batch and start it.

        ``record`` holds its id, ``api``, owner, ``created_at`` and ``expires_at`` (when
        what has not ended expires); it is kept for the retention after that.
        """
        now = int(time.time())
        record.update(
            status="in_progress",
            in_progress_at=now,
            total=len(lines),
            submitted=0,
            refused={},
            requeued=[],
            counts=_counts(len(lines)),
            kept_until=record["expires_at"] + self.retention_s,
        )
        blob = await asyncio.to_thread(encode_lines, lines)
        await self.objects.put(KIND, record["id"], record, blob)
        await self.objects.set_active(KIND, record["id"], True)
        await self.objects.claim(KIND, record["id"], self.manager.holder, LEASE_TTL_S)
        self._start(record["id"])
        return record

    async def get(self, batch_id: str, owner: str | None, api: str) -> dict[str, Any]:
        record = await self.objects.get(KIND, batch_id)
        if record is None or record.get("api") != api or not visible(record, owner):
            raise ApiError(
                404, f"No batch found with id {batch_id!r}", "not_found_error", "batch_id"
            )
        return await self._with_cancel(record)

    async def _with_cancel(self, record: dict[str, Any]) -> dict[str, Any]:
        """A running batch whose cancel was asked for is ``cancelling``."""
        if record["status"] == "in_progress":
            flag = await self.objects.get(CANCEL_KIND, record["id"])
            if flag is not None:
                record.update(status="cancelling", cancelling_at=int(flag["created_at"]))
        return record

    async def list(
        self, owner: str | None, api: str, limit: int, after: str | None, *, ascending: bool = False
    ) -> tuple[list[dict[str, Any]], bool]:
        """The owner's batches of ``api``, newest first unless ``ascending``, after ``after``."""
        records, more = await self.objects.list(
            KIND, owner, limit, after, ascending=ascending, where=lambda r: r.get("api") == api
        )
        return [await self._with_cancel(record) for record in records], more

    async def cancel(self, batch_id: str, owner: str | None, api: str) -> dict[str, Any]:
        """Ask the runner to stop: ``cancelling`` until its unfinished lines are cancelled.

        The request is an object of its own, so the runner's writes never undo it.
        """
        record = await self.get(batch_id, owner, api)
        if record["status"] != "in_progress":
            return record
        flag = {"created_at": time.time(), "kept_until": None, "owner": record.get("owner")}
        await self.objects.put(CANCEL_KIND, batch_id, flag)
        record.update(status="cancelling", cancelling_at=int(flag["created_at"]))
        return record

    async def delete(self, batch_id: str, owner: str | None, api: str) -> dict[str, Any]:
        """Forget an ended batch; its record, for the caller to forget what it made."""
        record = await self.get(batch_id, owner, api)
        if record["status"] not in ENDED:
            raise ApiError(
                400,
                f"Batch {batch_id!r} is {record['status']}: cancel it and wait for it to end "
                "before deleting it",
                "invalid_request_error",
                "batch_id",
            )
        await self.objects.delete(KIND, batch_id)
        return record

    # --- running ---------------------------------------------------------------------

    def _start(self, batch_id: str) -> None:
        if batch_id in self._running:
            return
        task = asyncio.create_task(self._run(batch_id), name=f"sluice-{batch_id}")
        self._running[batch_id] = task

        def forget(done: asyncio.Task[None]) -> None:
            self._running.pop(batch_id, None)
            if not done.cancelled() and done.exception() is not None:
                log.error("batch %s failed", batch_id, exc_info=done.exception())

        task.add_done_callback(forget)

    async def _run(self, batch_id: str) -> None:
        """Run the batch to its end; a store failure on the way is waited out, not fatal."""
        run = await self._load(batch_id)
        if run is None:
            return
        try:
            while (step := await _outlasting_the_store(self._advance, run)) is _Step.GO_ON:
                pass
        finally:
            for watcher in run.watchers.values():
                watcher.cancel()
        if step is _Step.FINALIZE:
            await _outlasting_the_store(self._finalize, run.record, run.lines)

    async def _load(self, batch_id: str) -> _Run | None:
        record = await self.objects.get(KIND, batch_id)
        blob = await self.objects.blob(KIND, batch_id)
        if record is None or blob is None:
            return None
        record.setdefault("requeued", [])
        waiting = set(record["refused"]) | {str(index) for index in record["requeued"]}
        outstanding = {index for index in range(record["submitted"]) if str(index) not in waiting}
        return _Run(record, blob, await asyncio.to_thread(Lines, blob), outstanding)

    async def _advance(self, run: _Run) -> _Step:
        """One round: look for a cancel or the window's end, submit, wait for a line to end."""
        record, lines, outstanding = run.record, run.lines, run.outstanding
        if not await self._still_kept(record, run.blob):  # deleted: nothing more to do
            return _Step.STOP
        if await self.objects.get(CANCEL_KIND, record["id"]) is not None:
            record["cancelling_at"] = int(time.time())
            await self._cancel_lines(record, outstanding)
            return _Step.FINALIZE
        if time.time() >= record["expires_at"]:  # its window closed: the rest expires
            record["expired_at"] = int(time.time())
            await self._cancel_lines(record, outstanding)
            return _Step.FINALIZE
        if time.monotonic() >= run.retry_at:
            run.retry_at = time.monotonic() + await self._submit_lines(record, lines, outstanding)
        if not outstanding and not _unsubmitted(record, lines):
            return _Step.GO_ON if await self._requeue_lost(record) else _Step.FINALIZE
        await self._wait_for_an_end(record, outstanding, run.watchers)
        record["counts"]["processing"] = len(outstanding) + _unsubmitted(record, lines)
        await self.objects.update(KIND, record["id"], record)
        return _Step.GO_ON

    async def _still_kept(self, record: dict[str, Any], blob: bytes) -> bool:
        """Whether the batch is still there to run; one whose record was lost (a Redis
        restart without persistence) is written back from what this runner holds, since
        nothing but a deletion (refused while it runs) may end a batch's record early."""
        if await self.objects.get(KIND, record["id"]) is not None:
            return True
        if time.time() >= record["kept_until"]:
            return False
        log.warning("batch %s: its record was lost; writing it back", record["id"])
        await self.objects.put(KIND, record["id"], record, blob)
        await self.objects.set_active(KIND, record["id"], True)
        return True

    async def _wait_for_an_end(
        self, record: dict[str, Any], outstanding: set[int], watchers: dict[int, asyncio.Task[None]]
    ) -> None:
        """Until a line's job ends (or ``POLL_S``, to look for a cancel); count what ended.

        Each running line has a watcher that reads its job's stream to the end, so a
        finished line is noticed as soon as its last chunk is stored, not at the next poll.
        A line whose job was lost, or failed in a way that says to retry later, is queued
        again rather than counted.
        """
        for index in outstanding - watchers.keys():
            job_id = _job_id(record, index)
            watchers[index] = asyncio.create_task(self._ended(job_id), name=f"sluice-{job_id}")
        if not watchers:
            await asyncio.sleep(POLL_S)
            return
        await asyncio.wait(watchers.values(), timeout=POLL_S, return_when="FIRST_COMPLETED")
        for index in [index for index, watcher in watchers.items() if watcher.done()]:
            watcher = watchers.pop(index)
            if not watcher.cancelled():
                watcher.exception()  # a read the store cut short: the record read next decides
            job_id = _job_id(record, index)
            job = await self.manager.store.get(job_id)
            if job is not None and not job.status.terminal:
                continue  # its stream was cut (an adopting replica re-reads it): watch again
            outstanding.discard(index)
            if job is None or _retry_after(job) is not None:
                _requeue(record, index)
                continue
            record["counts"][_job_outcome(Line("", "", {}), job).kind] += 1

    async def _requeue_lost(self, record: dict[str, Any]) -> bool:
        """Queue again the ended lines whose jobs are gone (a Redis restart took them and
        their results), counting the lines anew; whether there were any. Run before
        finalizing, so that the outputs hold every line."""
        counts = _counts(0)
        counts["errored"] = len(record["refused"])
        waiting = set(record["requeued"])
        for index in range(record["submitted"]):
            if str(index) in record["refused"] or index in waiting:
                continue
            job = await self.manager.store.get(_job_id(record, index))
            if job is None:
                _requeue(record, index)
            else:
                counts[_job_outcome(Line("", "", {}), job).kind] += 1
            if index % LINES_PER_PASS == LINES_PER_PASS - 1:
                await asyncio.sleep(0)
        lost = len(record["requeued"]) - len(waiting)
        if lost:
            log.warning("batch %s: %d lines lost their jobs; they run again", record["id"], lost)
            record["counts"] = {**counts, "processing": len(record["requeued"])}
        return lost > 0

    async def _ended(self, job_id: str) -> None:
        """Returns when the job's stream ends: the job reached a terminal status."""
        store = self.manager.store
        async for _ in store.read(job_id, await store.chunk_count(job_id)):
            pass

    async def _submit_lines(
        self, record: dict[str, Any], lines: Lines, outstanding: set[int]
    ) -> float:
        """Submit lines in order while the window has room; the seconds to wait before
        submitting again when a refusal says when to retry (0 when none did).

        A refusal without ``Retry-After`` (a body the endpoint refuses, a request larger
        than the key's tokens per minute) fails its line at once; one with it (the key's
        rate limits, a full server) keeps the line next in order until then.
        """
        key = self.keys.named(record.get("owner"))
        protocols = self.manager.protocols
        while len(outstanding) < self.window and _unsubmitted(record, lines):
            index = record["requeued"][0] if record["requeued"] else record["submitted"]
            line = lines[index]
            job = JobRequest(
                protocols[line.endpoint],
                line.body,
                {"batch": record["id"], "custom_id": line.custom_id[:512]},
                job_hex=_line_hex(record, index),
                priority=BATCH_PRIORITY,
                events=False,
            )
            if await self.manager.store.get(f"job_{job.job_hex}") is None:
                try:
                    await self.manager.submit([job], key, owner=record.get("owner"))
                except SubmitError as exc:
                    wait = exc.error.retry_after_s
                    if wait is not None:
                        return max(wait, POLL_S)
                    body = job.protocol.error_body(exc.error)
                    record["refused"][str(index)] = {"status": exc.error.status, "body": body}
                    record["counts"]["errored"] += 1
                    _take(record, index)
                    continue
            outstanding.add(index)
            _take(record, index)
        return 0.0

    async def _cancel_lines(self, record: dict[str, Any], outstanding: set[int]) -> None:
        for index in outstanding:
            with contextlib.suppress(ApiError):
                await self.manager.cancel(_job_id(record, index), record.get("owner"))

    async def _finalize(self, record: dict[str, Any], lines: Lines) -> None:
        record.update(status="finalizing", finalizing_at=int(time.time()))
        await self.objects.update(KIND, record["id"], record)
        counts = _counts(0)
        outcomes = self._outcomes(record, lines, counts)
        record.update(await self.finalizers[record["api"]](record, outcomes))
        record["counts"] = counts
        if record.get("expired_at") is not None:
            record["status"] = "expired"
        else:
            ended = "cancelled" if record.get("cancelling_at") is not None else "completed"
            record.update(status=ended, **{f"{ended}_at": int(time.time())})
        await self.objects.update(KIND, record["id"], record)
        await self.objects.set_active(KIND, record["id"], False)
        await self.objects.delete(CANCEL_KIND, record["id"])

    async def _outcomes(
        self, record: dict[str, Any], lines: Lines, counts: dict[str, int]
    ) -> AsyncIterator[list[Outcome]]:
        """Every line's outcome, in order, ``LINES_PER_PASS`` at a time, each counted into
        ``counts``: a large batch's outputs are written a part at a time, never held whole."""
        for start in range(0, len(lines), LINES_PER_PASS):
            part = []
            for index in range(start, min(start + LINES_PER_PASS, len(lines))):
                outcome = await self._outcome(record, index, lines[index])
                counts[outcome.kind] += 1
                part.append(outcome)
            yield part

    async def _outcome(self, record: dict[str, Any], index: int, line: Line) -> Outcome:
        refused = record["refused"].get(str(index))
        if refused is not None:
            return Outcome(line.custom_id, "errored", None, refused["status"], refused["body"])
        unfinished = "expired" if record.get("expired_at") is not None else "canceled"
        if index >= record["submitted"] or index in record["requeued"]:
            return Outcome(line.custom_id, unfinished)
        outcome = _job_outcome(line, await self.manager.store.get(_job_id(record, index)))
        if outcome.kind == "canceled":  # cut short by the batch's cancel or by its expiry
            outcome.kind = unfinished
        return outcome

    # --- takeover ----------------------------------------------------------------------

    async def _maintain(self) -> None:
        """Renew the leases of batches running here; take over those whose runner is gone."""
        holder = self.manager.holder
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                for batch_id in await self.objects.active(KIND):
                    mine = batch_id in self._running
                    if await self.objects.claim(KIND, batch_id, holder, LEASE_TTL_S):
                        if not mine:
                            log.info("taking over batch %s", batch_id)
                            self._start(batch_id)
                    elif mine:  # another process holds it now
                        self._running[batch_id].cancel()
            except store_errors() as exc:
                log.warning("batch maintenance failed: %s", exc)


class _Step(Enum):
    GO_ON = "go on"
    FINALIZE = "finalize"  # every line ended, or the batch was cancelled or expired
    STOP = "stop"  # the batch is gone


@dataclass(slots=True)
class _Run:
    """One batch's run in this process: its record, its lines, and what is in flight."""

    record: dict[str, Any]
    blob: bytes
    lines: Lines
    outstanding: set[int]  # lines whose jobs are submitted and not yet counted
    watchers: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    retry_at: float = 0.0  # time.monotonic() before which a refused submission is not retried


async def _outlasting_the_store(step: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``step(*args)``, again after a pause each time the store fails (Redis restarting)."""
    while True:
        try:
            return await step(*args)
        except store_errors() as exc:
            log.warning("a batch step failed on the store (%s); trying again", exc)
            await asyncio.sleep(STORE_RETRY_S)


def encode_lines(lines: list[Line]) -> bytes:
    """A batch's lines as its blob: JSON lines, one dump each, so that encoding a large batch
    on a thread lets the event loop run between lines."""
    return "\n".join(
        json.dumps({"custom_id": x.custom_id, "endpoint": x.endpoint, "body": x.body})
        for x in lines
    ).encode()


class Lines:
    """A batch's lines as ``encode_lines``' blob holds them (or a blob written as one JSON
    array), each decoded when it is read: 100,000 lines kept decoded would be millions of
    objects for the collector to walk for as long as the batch runs."""

    __slots__ = ("_raw",)

    def __init__(self, blob: bytes) -> None:
        if blob.startswith(b"["):
            self._raw = [json.dumps(line).encode() for line in json.loads(blob)]
        else:
            self._raw = blob.split(b"\n")

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, index: int) -> Line:
        return Line(**json.loads(self._raw[index]))


def refuse_unknown(body: dict[str, Any], known: tuple[str, ...]) -> None:
    """A 400 for a field a create route does not read: it would otherwise be ignored."""
    for name in body:
        if name not in known:
            raise bad_request(
                f"{name} is not supported here; the accepted fields are {', '.join(known)}",
                name,
                "unsupported_parameter",
            )


def _job_outcome(line: Line, job: JobRecord | None) -> Outcome:
    if job is None or job.status is JobStatus.EXPIRED:
        return Outcome(line.custom_id, "expired")
    if job.status is JobStatus.COMPLETED:
        return Outcome(line.custom_id, "succeeded", job.response_id, 200, job.result)
    if job.status is JobStatus.FAILED:
        error = job.error or {}
        status = int(error.get("status", 500))
        body = {"error": {"message": error.get("message", ""), "type": error.get("type")}}
        return Outcome(line.custom_id, "errored", job.response_id, status, body)
    return Outcome(line.custom_id, "canceled", job.response_id)


def _unsubmitted(record: dict[str, Any], lines: Lines) -> int:
    """Lines not submitted yet: those never taken, and those queued again."""
    return len(lines) - record["submitted"] + len(record["requeued"])


def _take(record: dict[str, Any], index: int) -> None:
    """Line ``index`` is submitted (or refused): it leaves the lines to submit."""
    if record["requeued"] and record["requeued"][0] == index:
        record["requeued"].pop(0)
    else:
        record["submitted"] += 1


def _retry_after(job: JobRecord) -> float | None:
    """When a failed job's error said a retry may succeed (a lost worker, a full queue)."""
    if job.status is not JobStatus.FAILED or job.error is None:
        return None
    return job.error.get("retry_after")


def _counts(processing: int) -> dict[str, int]:
    return {"processing": processing, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}


def _line_hex(record: dict[str, Any], index: int) -> str:
    """The random part of line ``index``'s job id: the batch's, the line's number and, once the
    line is queued again, its attempt, so that a new run never meets an old one's events."""
    attempt = record.get("attempts", {}).get(str(index), 0)
    return record["id"].split("_", 1)[1] + f"{index:08x}" + (f"{attempt:02x}" if attempt else "")


def _job_id(record: dict[str, Any], index: int) -> str:
    return "job_" + _line_hex(record, index)


def _requeue(record: dict[str, Any], index: int) -> None:
    """Line ``index`` is to be submitted again, as its next attempt."""
    attempts = record.setdefault("attempts", {})
    attempts[str(index)] = attempts.get(str(index), 0) + 1
    record["requeued"].append(index)


__all__ = [
    "BATCH_PRIORITY",
    "Batches",
    "Line",
    "Outcome",
    "Lines",
    "encode_lines",
    "refuse_unknown",
]
