"""The jobs of one API process: submit, read, list and cancel them; run and adopt them.

Submitting prepares the body exactly as the synchronous route would (same
admission, same 400s), starts the generation (embedded: the backend's
``infer``; distributed: the process's request channel,
``api.backends.channel``, which keeps a job's generation going when its
reader ends with this process), saves the
record with this process's runner lease and starts a ``JobRunner`` on the
events. The job's id and its response's id share one random part
(``job_<hex>``, ``chatcmpl-<hex>``), and the response id is the engine's
request id too.

Adoption (a shared store in distributed mode): runners renew their leases
every third of the lease TTL. A job that is queued or running with no lease
has lost its runner (its API process stopped or crashed) while its
generation goes on on a worker. Any process that meets such a job (reading
it, or its periodic scan of unfinished jobs) takes the lease, re-prepares
the body, re-attaches to the request's event stream from the start and
continues: the replay rebuilds the chunks already stored and writes only
the rest. On shutdown this process detaches its runners rather than
cancelling them, and gives their leases back so that another process (or
this one, restarted) adopts them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI

from api.error_kinds import error_for
from api.errors import ApiError
from api.jobs.records import JobOutcome, JobRecord, JobStatus, StoredChunk, new_job_hex
from api.jobs.runner import JobRunner, failure_of, job_processor
from api.jobs.store import JobStore
from api.preparation import Prepared
from api.protocols.base import Protocol
from api.store_errors import store_errors
from shared.events import Error
from shared.wire import QueuedRequest

if TYPE_CHECKING:
    from api.auth import ApiKey
    from api.backends.channel import RequestChannel
    from api.rate_limits import RateLimitTicket
    from api.serving import Serving

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # a local runner ends within an engine step; this bounds a stuck one
STOP_WAIT_S = 5.0
DEFAULT_MAINTAIN_INTERVAL_S = 3.0


# A body and its owner → the body as the synchronous route would prepare it.
Resolver = Callable[[dict, str | None], Awaitable[dict]]


@dataclass(slots=True)
class JobRequest:
    """One submission: the protocol the body is for, the body, the caller's metadata.

    ``job_hex`` fixes the job's id (a batch names its lines' jobs, so that whoever
    continues the batch finds them); ``priority`` is the least urgent the job runs at;
    without ``events`` only the outcome is kept, not the stream (a batch reads no stream).
    """

    protocol: Protocol
    body: dict
    metadata: dict[str, str]
    job_hex: str | None = None
    priority: int = 0
    events: bool = True


class SubmitError(Exception):
    """A job body the synchronous route would have refused; rendered in its protocol's shape."""

    def __init__(self, protocol: Protocol, error: ApiError, index: int) -> None:
        super().__init__(error.message)
        self.protocol = protocol
        self.error = error
        self.index = index  # the job's place in its batch


class JobManager:
    """See the module docstring; ``queue`` is set in distributed mode."""

    def __init__(
        self,
        serving: Serving,
        store: JobStore,
        protocols: dict[str, Protocol],
        channel: RequestChannel | None = None,
    ) -> None:
        self.serving = serving
        self.store = store
        self.protocols = protocols
        self.holder = uuid.uuid4().hex
        # By protocol path: what completes a body before it is prepared (``submit``).
        self.resolvers: dict[str, Resolver] = {}
        self._channel = channel
        self._runners: dict[str, tuple[JobRunner, asyncio.Task[None]]] = {}
        self._maintainer: asyncio.Task[None] | None = None
        lease = getattr(store, "lease_ttl_s", None)
        self._interval = lease / 3 if lease else DEFAULT_MAINTAIN_INTERVAL_S

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self._channel is not None:
            await self._channel.start()
        if self._adopting:
            self._maintainer = asyncio.create_task(self._maintain(), name="sluice-jobs")
        try:
            yield
        finally:
            await self.stop()

    @property
    def _adopting(self) -> bool:
        return self._channel is not None and self.store.shared

    # --- what the routes call ------------------------------------------------------

    async def submit(
        self, jobs: list[JobRequest], key: ApiKey | None, owner: str | None = None
    ) -> list[JobRecord]:
        """Prepare every body and take its share of ``key``'s limits first (one refused body
        queues nothing), then start them all. The jobs belong to ``key`` (else ``owner``).
        """
        owner = key.name if key is not None else owner
        prepared: list[tuple[str, Prepared]] = []
        for index, job in enumerate(jobs):
            job_hex = job.job_hex or new_job_hex()
            try:
                job.body = await self._resolve(job, owner)
                ready = await self._prepare(job.protocol, job.body, job_hex, key=key)
            except ApiError as exc:
                _release_prepared(prepared)
                raise SubmitError(job.protocol, exc, index) from exc
            ready.wire.priority = max(ready.wire.priority, job.priority)
            prepared.append((job_hex, ready))
        try:
            tickets = await self._limit(jobs, [ready for _, ready in prepared], key)
        except SubmitError:
            _release_prepared(prepared)
            raise
        records = []
        for index, (job, (job_hex, ready)) in enumerate(zip(jobs, prepared, strict=True)):
            record = self._new_record(job, job_hex, ready, owner)
            try:
                events = await self._generate(record, ready)
            except ApiError as exc:  # the queue refused it: nothing runs, nothing is kept
                await _release_unused(tickets[index:])
                _release_prepared(prepared[index:])
                raise SubmitError(job.protocol, exc, index) from exc
            await self.store.create(record, self.holder)
            self._launch(self._runner(record, ready, events), tickets[index])
            records.append(record)
        return records

    async def _resolve(self, job: JobRequest, owner: str | None) -> dict:
        """The body with what it refers to filled in by its protocol's resolver (the Responses
        API's ``previous_response_id``), as the synchronous route would see it."""
        resolver = self.resolvers.get(job.protocol.path)
        return job.body if resolver is None else await resolver(job.body, owner)

    async def _limit(
        self, jobs: list[JobRequest], prepared: list[Prepared], key: ApiKey | None
    ) -> list[RateLimitTicket | None]:
        """Each job's share of the key's requests and tokens per minute, or none at all (429)."""
        tickets: list[RateLimitTicket | None] = []
        for index, (job, ready) in enumerate(zip(jobs, prepared, strict=True)):
            try:
                tickets.append(await self.serving.limit(key, ready, holds_place=False))
            except ApiError as exc:
                await _release_unused(tickets)
                raise SubmitError(job.protocol, exc, index) from exc
        return tickets

    async def get(self, job_id: str, owner: str | None) -> JobRecord:
        """The job (or its tombstone), adopting it first if its runner is gone; else 404."""
        record = await self.store.get(job_id)
        if record is None or not record.visible_to(owner):
            raise self._unknown(job_id)
        await self._adopt_if_stranded(record)
        return record

    async def events(
        self, job_id: str, owner: str | None, after: int
    ) -> AsyncIterator[tuple[int, StoredChunk]]:
        """The job's chunks after ``after``, live until it ends; 404 once expired."""
        record = await self.get(job_id, owner)
        if record.status is JobStatus.EXPIRED:
            message = f"Job {job_id!r} expired: its retention ended and its events are gone."
            raise ApiError(404, message, "not_found_error", code="job_expired")
        return self.store.read(job_id, after)

    async def list(
        self, owner: str | None, status: JobStatus | None, limit: int, after: str | None
    ) -> tuple[list[JobRecord], bool]:
        """The owner's jobs, newest first, after the job ``after``: a cursor that is not one of
        the owner's jobs lists nothing, as an unknown one does (it tells nothing of others')."""
        if after is not None:
            cursor = await self.store.get(after)
            if cursor is None or not cursor.visible_to(owner):
                return [], False
        return await self.store.list(owner=owner, status=status, limit=limit, after=after)

    async def cancel(self, job_id: str, owner: str | None) -> JobRecord:
        """Stop the job wherever it runs; a finished job is answered as it is."""
        record = await self.get(job_id, owner)
        if record.status.terminal:
            return record
        local = self._runners.get(job_id)
        if local is not None and not local[0].detached:
            runner, task = local
            runner.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), CANCEL_WAIT_S)
        else:  # another process runs it (or nobody does): end it here, stop its generation
            await self.store.finish(job_id, JobOutcome(JobStatus.CANCELLED, record.usage))
            if self._channel is not None:
                await self._channel.cancel(record.response_id)
        return await self.get(job_id, owner)

    async def stop(self) -> None:
        """Shutdown: detach from shared jobs (others adopt them), cancel in-memory ones.

        The channel is marked stopping first, so that the detached runners'
        event streams, which end when the channel's last user stops it, cancel
        no generation.
        """
        if self._maintainer is not None:
            self._maintainer.cancel()
        if self._channel is not None:
            self._channel.stopping = True
        runners = list(self._runners.values())
        for runner, _ in runners:
            if self.store.shared:
                runner.detach()
                with contextlib.suppress(*store_errors()):
                    await self.store.release(runner.job_id, self.holder)
            else:
                runner.cancel()
        if not self.store.shared and runners:
            await asyncio.wait([task for _, task in runners], timeout=STOP_WAIT_S)
        if self._channel is not None:
            await self._channel.stop()
        await self.store.close()

    # --- running and adopting --------------------------------------------------------

    async def _prepare(
        self,
        protocol: Protocol,
        body: dict,
        job_hex: str,
        *,
        admit: bool = True,
        key: ApiKey | None = None,
    ) -> Prepared:
        """The synchronous route's preparation, with the job's response (and request) id.

        ``key`` bounds the models and priority as on the synchronous route.
        """
        response_id = protocol.id_prefix + job_hex
        if admit:
            # The admission check only: a job holds no connection, and the engine or the
            # queue holds its place once it runs.
            (await self.serving.admit(body)).release()
        return await self.serving.prepare(protocol, body, response_id, key)

    async def _generate(self, record: JobRecord, prepared: Prepared) -> AsyncIterator:
        """Start the generation: on the workers (a 503 if it cannot be queued), or here."""
        arrived = time.monotonic()
        if self._channel is None:
            events = prepared.holding(self.serving.backend.infer(prepared.wire))
            return self.serving.metrics.track(prepared, events, arrived)
        job = QueuedRequest(prepared.wire, self._channel.limits.job_deadlines(record.created_at))
        job, queued = await self._channel.submit(job)
        if isinstance(queued, Error):
            raise error_for(queued)
        events = prepared.holding(self._channel.follow(job, queued))
        return self.serving.metrics.track(prepared, events, arrived)

    def _new_record(
        self, job: JobRequest, job_hex: str, prepared: Prepared, owner: str | None
    ) -> JobRecord:
        now = time.time()
        return JobRecord(
            id=f"job_{job_hex}",
            endpoint=job.protocol.path,
            body=job.body,
            metadata=job.metadata,
            owner=owner,
            response_id=prepared.context.request_id,
            response_created=prepared.context.created,
            created_at=now,
            expires_at=now + self.store.retention_s,
            events=job.events,
        )

    def _runner(
        self,
        record: JobRecord,
        prepared: Prepared,
        events: AsyncIterator,
        kept: list[StoredChunk] | None = None,
    ) -> JobRunner:
        return JobRunner(
            self.store,
            record,
            job_processor(prepared, record),
            events,
            done_marker=prepared.protocol.done_marker,
            holder=self.holder,
            kept=kept,
        )

    def _launch(self, runner: JobRunner, ticket: RateLimitTicket | None = None) -> None:
        """Run the job; its key's unused tokens go back when it ends (``ticket``)."""

        async def run() -> None:
            try:
                await runner.run()
            finally:
                if ticket is not None:
                    # A job that went on elsewhere (detached) keeps its whole reservation.
                    used = ticket.reserved if runner.detached else runner.used_tokens
                    await asyncio.shield(ticket.release(used))

        task = asyncio.create_task(run(), name=f"sluice-{runner.job_id}")
        self._runners[runner.job_id] = (runner, task)

        def forget(done: asyncio.Task[None]) -> None:
            if self._runners.get(runner.job_id, (None, None))[1] is done:
                del self._runners[runner.job_id]
            if not done.cancelled() and done.exception() is not None:
                log.error("job %s failed", runner.job_id, exc_info=done.exception())

        task.add_done_callback(forget)

    def _runs_here(self, job_id: str) -> bool:
        local = self._runners.get(job_id)
        return local is not None and not local[0].detached

    async def _adopt_if_stranded(self, record: JobRecord) -> None:
        """Take over a job whose runner is gone (shared store, distributed mode)."""
        if not self._adopting or record.status.terminal or self._runs_here(record.id):
            return
        if not self.serving.backend.health().ready:
            return  # no tokenizer yet to re-prepare with; the scan comes back to it
        if await self.store.claim(record.id, self.holder):  # else its runner is alive elsewhere
            await self._adopt(record.id)

    async def _adopt(self, job_id: str) -> None:
        """With the lease taken: run the job from its request's event stream, or give it back."""
        try:
            record = await self.store.get(job_id)  # fresh: it may have ended meanwhile
            if record is not None and not record.status.terminal:
                await self._replay(record)
                return
        except Exception:
            log.exception("adopting job %s failed", job_id)
        await self.store.release(job_id, self.holder)

    async def _replay(self, record: JobRecord) -> None:
        assert self._channel is not None
        protocol = self.protocols[record.endpoint]
        job_hex = record.id.removeprefix("job_")
        try:
            prepared = await self._prepare(protocol, record.body, job_hex, admit=False)
        except ApiError as exc:  # e.g. the model this job asked for is no longer served
            await self.store.finish(record.id, JobOutcome(JobStatus.FAILED, error=failure_of(exc)))
            return
        kept = await self._stored_chunks(record.id)
        deadlines = self._channel.limits.adoption_deadlines(record.created_at)
        events = prepared.holding(self._channel.follow(QueuedRequest(prepared.wire, deadlines)))
        log.info("adopting job %s (%d chunks already stored)", record.id, len(kept))
        self._launch(self._runner(record, prepared, events, kept))

    async def _stored_chunks(self, job_id: str) -> list[StoredChunk]:
        count = await self.store.chunk_count(job_id)
        kept: list[StoredChunk] = []
        if count == 0:
            return kept
        reader = self.store.read(job_id, 0)
        try:
            async for _, chunk in reader:
                kept.append(chunk)
                if len(kept) == count:
                    break
        finally:
            await reader.aclose()  # type: ignore[attr-defined]
        return kept

    async def _maintain(self) -> None:
        """Renew this process's leases; adopt jobs whose runner is gone."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._renew()
                if not self.serving.backend.health().ready:
                    continue
                for job_id in await self.store.unfinished():
                    if not self._runs_here(job_id) and await self.store.claim(job_id, self.holder):
                        await self._adopt(job_id)
            except store_errors() as exc:
                log.warning("job maintenance failed: %s", exc)

    async def _renew(self) -> None:
        mine = [job_id for job_id in list(self._runners) if self._runs_here(job_id)]
        held = await self.store.renew(mine, self.holder)
        for job_id in set(mine) - held:
            log.warning("job %s: lost its runner lease; another process continues it", job_id)
            self._runners[job_id][0].detach()

    def _unknown(self, job_id: str) -> ApiError:
        kept, tombstone = _duration(self.store.retention_s), _duration(self.store.tombstone_s)
        message = (
            f"No job {job_id!r}: it never existed, or it expired and was forgotten (a job is "
            f"kept {kept} after submission, then answered as expired for {tombstone} more)."
        )
        return ApiError(404, message, "not_found_error", "job_id", "job_not_found")


async def _release_unused(tickets: list[RateLimitTicket | None]) -> None:
    """Give back the whole shares of jobs that were refused before they ran: a refused
    batch spends none of its key's requests or tokens."""
    for ticket in tickets:
        if ticket is not None:
            await ticket.give_back()


def _release_prepared(prepared: list[tuple[str, Prepared]]) -> None:
    """Give back what the preparation of jobs that will not run reserved (images' tokens)."""
    for _, ready in prepared:
        ready.release()


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    return f"{seconds:g}s"


__all__ = ["JobManager", "JobRequest", "SubmitError"]
