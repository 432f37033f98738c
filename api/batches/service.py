"""Batches: many requests, each run as an async job, their outcomes gathered at the end.

A batch is a record (``api.batches.objects``, kind ``batch``) with its lines
(custom id, endpoint, body) as its blob. Its runner submits the lines as jobs
in order, at most ``window`` unfinished at once and at ``BATCH_PRIORITY``, so
a batch never crowds out interactive requests: the queue and the engine serve
more urgent work first. A line the endpoint refuses (a 400) fails that line
only; a refusal that says "later" (429, 503) is retried.

Line ``i``'s job id is the batch's random part followed by ``i``, so the
lines' jobs can be found again: when the replica running a batch stops, its
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
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from api.batches.objects import ObjectStore, visible
from api.errors import ApiError, bad_request
from api.jobs.manager import JobManager, JobRequest, SubmitError
from api.jobs.records import JobRecord, JobStatus
from api.store_errors import store_errors

if TYPE_CHECKING:
    from api.auth import KeyRing

log = logging.getLogger(__name__)

KIND = "batch"
CANCEL_KIND = "batch_cancel"
BATCH_PRIORITY = 6  # kombu's third priority step: interactive requests (0) go first
POLL_S = 0.25
LEASE_TTL_S = 10.0
ENDED = ("completed", "cancelled", "failed", "expired")
RETRY_LATER = (429, 503)


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


# Writes a batch's outputs from its outcomes; returns the fields to add to its record.
Finalizer = Callable[[dict[str, Any], list[Outcome]], Awaitable[dict[str, Any]]]


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
            counts=_counts(len(lines)),
            kept_until=record["expires_at"] + self.retention_s,
        )
        blob = json.dumps([asdict(line) for line in lines]).encode()
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
        self, owner: str | None, api: str, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        records, _ = await self.objects.list(KIND, owner, 10_000, after)
        mine = [await self._with_cancel(r) for r in records if r.get("api") == api]
        return mine[:limit], len(mine) > limit

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

    async def delete(self, batch_id: str, owner: str | None, api: str) -> None:
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
        record = await self.objects.get(KIND, batch_id)
        blob = await self.objects.blob(KIND, batch_id)
        if record is None or blob is None:
            return
        lines = [Line(**line) for line in json.loads(blob)]
        outstanding = {
            index for index in range(record["submitted"]) if str(index) not in record["refused"]
        }
        watchers: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                if await self.objects.get(KIND, batch_id) is None:  # deleted or expired
                    return
                if await self.objects.get(CANCEL_KIND, batch_id) is not None:
                    record["cancelling_at"] = int(time.time())
                    await self._cancel_lines(record, outstanding)
                    break
                if time.time() >= record["expires_at"]:  # its window closed: the rest expires
                    record["expired_at"] = int(time.time())
                    await self._cancel_lines(record, outstanding)
                    break
                await self._submit_lines(record, lines, outstanding)
                await self._wait_for_an_end(record, outstanding, watchers)
                record["counts"]["processing"] = len(outstanding) + len(lines) - record["submitted"]
                await self.objects.update(KIND, batch_id, record)
                if not outstanding and record["submitted"] == len(lines):
                    break
        finally:
            for watcher in watchers.values():
                watcher.cancel()
        await self._finalize(record, lines)

    async def _wait_for_an_end(
        self, record: dict[str, Any], outstanding: set[int], watchers: dict[int, asyncio.Task[None]]
    ) -> None:
        """Until a line's job ends (or ``POLL_S``, to look for a cancel); count what ended.

        Each running line has a watcher that reads its job's stream to the end, so a
        finished line is noticed as soon as its last chunk is stored, not at the next poll.
        """
        for index in outstanding - watchers.keys():
            job_id = _job_id(record["id"], index)
            watchers[index] = asyncio.create_task(self._ended(job_id), name=f"sluice-{job_id}")
        if watchers:
            await asyncio.wait(watchers.values(), timeout=POLL_S, return_when="FIRST_COMPLETED")
        for index in [index for index, watcher in watchers.items() if watcher.done()]:
            del watchers[index]
            job = await self.manager.store.get(_job_id(record["id"], index))
            if job is not None and not job.status.terminal:
                continue  # its stream was cut (an adopting replica re-reads it): watch again
            outstanding.discard(index)
            record["counts"][_job_outcome(Line("", "", {}), job).kind] += 1

    async def _ended(self, job_id: str) -> None:
        """Returns when the job's stream ends: the job reached a terminal status."""
        store = self.manager.store
        async for _ in store.read(job_id, await store.chunk_count(job_id)):
            pass

    async def _submit_lines(
        self, record: dict[str, Any], lines: list[Line], outstanding: set[int]
    ) -> None:
        key = self.keys.named(record.get("owner"))
        protocols = self.manager.protocols
        while record["submitted"] < len(lines) and len(outstanding) < self.window:
            index = record["submitted"]
            line = lines[index]
            job = JobRequest(
                protocols[line.endpoint],
                line.body,
                {"batch": record["id"], "custom_id": line.custom_id[:512]},
                job_hex=_line_hex(record["id"], index),
                priority=BATCH_PRIORITY,
                events=False,
            )
            if await self.manager.store.get(f"job_{job.job_hex}") is None:
                try:
                    await self.manager.submit([job], key, owner=record.get("owner"))
                except SubmitError as exc:
                    if exc.error.status in RETRY_LATER:
                        return  # the server or the key is full: try again next round
                    body = job.protocol.error_body(exc.error)
                    record["refused"][str(index)] = {"status": exc.error.status, "body": body}
                    record["counts"]["errored"] += 1
                    record["submitted"] += 1
                    continue
            outstanding.add(index)
            record["submitted"] += 1

    async def _cancel_lines(self, record: dict[str, Any], outstanding: set[int]) -> None:
        for index in outstanding:
            with contextlib.suppress(ApiError):
                await self.manager.cancel(_job_id(record["id"], index), record.get("owner"))

    async def _finalize(self, record: dict[str, Any], lines: list[Line]) -> None:
        record.update(status="finalizing", finalizing_at=int(time.time()))
        await self.objects.update(KIND, record["id"], record)
        outcomes = [await self._outcome(record, index, line) for index, line in enumerate(lines)]
        counts = _counts(0)
        for outcome in outcomes:
            counts[outcome.kind] += 1
        record["counts"] = counts
        record.update(await self.finalizers[record["api"]](record, outcomes))
        if record.get("expired_at") is not None:
            record["status"] = "expired"
        else:
            ended = "cancelled" if record.get("cancelling_at") is not None else "completed"
            record.update(status=ended, **{f"{ended}_at": int(time.time())})
        await self.objects.update(KIND, record["id"], record)
        await self.objects.set_active(KIND, record["id"], False)
        await self.objects.delete(CANCEL_KIND, record["id"])

    async def _outcome(self, record: dict[str, Any], index: int, line: Line) -> Outcome:
        refused = record["refused"].get(str(index))
        if refused is not None:
            return Outcome(line.custom_id, "errored", None, refused["status"], refused["body"])
        unfinished = "expired" if record.get("expired_at") is not None else "canceled"
        if index >= record["submitted"]:
            return Outcome(line.custom_id, unfinished)
        outcome = _job_outcome(line, await self.manager.store.get(_job_id(record["id"], index)))
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


def _counts(processing: int) -> dict[str, int]:
    return {"processing": processing, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}


def _line_hex(batch_id: str, index: int) -> str:
    return batch_id.split("_", 1)[1] + f"{index:08x}"


def _job_id(batch_id: str, index: int) -> str:
    return "job_" + _line_hex(batch_id, index)


__all__ = ["BATCH_PRIORITY", "Batches", "Line", "Outcome", "refuse_unknown"]
