"""Runs one job in the background: inference events in, protocol chunks stored, outcome saved.

The runner drives the same ``StreamProcessor`` as the synchronous routes,
so the stored chunks are the synchronous stream and the result is what
``collect`` would have answered. It writes chunks in order, numbered from 1,
then the outcome (``finish`` closes the stream). Chat Completions' ``[DONE]``
is the last chunk, as on the wire.

Replaying must give the same chunks, because a job can be adopted by
another API process (``api.jobs.manager``) that replays the request's raw
events from the start and continues where the stored chunks end. So the
response's identity comes from the record (``job_processor``), tool-call
ids from a generator seeded by the job id, and any other id a protocol
builder draws afresh (the Responses API's item ids) is translated back to
the stored spelling by an ``IdAligner`` that learns the mapping from the
chunks it skips.

Ownership: the runner owns ``events``. It closes them (in a shielded scope)
when it ends, which cancels the request, exactly as the synchronous routes
do, except when it was told to ``detach`` (shutdown, a lost lease, a failing
store): then it stops writing and reads the events to their end, cancelling
nothing itself, so the generation carries on for whoever adopts the job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import string
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import anyio

from api.errors import ApiError
from api.jobs.records import JobOutcome, JobRecord, JobStatus, StoredChunk
from api.jobs.store import JobEnded, JobStore
from api.output_parser import OutputParser
from api.preparation import Prepared
from api.protocols.base import SSEChunk
from api.store_errors import store_errors
from api.streaming import StreamProcessor, chunk_data
from shared.events import Accepted, Finish, FinishReason, InferenceEvent

log = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_letters + string.digits


class _Cancelled:
    """What ``_next`` returns once ``cancel`` cut the wait short."""


_CANCELLED = _Cancelled()


def seeded_tool_call_ids(job_id: str) -> Callable[[], str]:
    """``call_…`` ids like the parser's own, but the same for every run of one job."""
    count = 0

    def next_id() -> str:
        nonlocal count
        count += 1
        digest = hashlib.sha256(f"{job_id}:{count}".encode()).digest()
        return "call_" + "".join(_ID_ALPHABET[byte % len(_ID_ALPHABET)] for byte in digest[:24])

    return next_id


def job_processor(prepared: Prepared, record: JobRecord) -> StreamProcessor:
    """The processor ``Serving.run`` would build, with the job's identity and tool-call ids."""
    context = replace(
        prepared.context, request_id=record.response_id, created=record.response_created
    )
    return StreamProcessor(
        prepared.protocol.builder(prepared.request, context),
        OutputParser(prepared.parser_config, seeded_tool_call_ids(record.id)),
        prepared.model.tokenizer,
        prompt_tokens=len(prepared.wire.prompt_token_ids),
        logprobs=prepared.request.logprobs is not None,
    )


def stored(chunk: SSEChunk) -> StoredChunk:
    """Serialised by the synchronous stream's own function: the same bytes."""
    return StoredChunk(chunk_data(chunk), chunk.event)


class IdAligner:
    """Maps ids a replay drew afresh to the ones the first run stored.

    Replayed chunks equal the stored ones except for such ids, so walking
    both side by side finds them: every string that differs at the same
    place. Later chunks and the final object are translated with the map.
    """

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}

    def learn(self, replayed: SSEChunk, kept: StoredChunk) -> None:
        if not isinstance(replayed.data, str):
            self._walk(replayed.data, json.loads(kept.data))

    def apply(self, value: Any) -> Any:
        if not self._ids:
            return value
        if isinstance(value, str):
            return self._ids.get(value, value)
        if isinstance(value, dict):
            return {key: self.apply(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.apply(item) for item in value]
        return value

    def chunk(self, chunk: SSEChunk) -> SSEChunk:
        return chunk if isinstance(chunk.data, str) else replace(chunk, data=self.apply(chunk.data))

    def _walk(self, new: Any, old: Any) -> None:
        if isinstance(new, str) and isinstance(old, str) and new != old:
            self._ids[new] = old
        elif isinstance(new, dict) and isinstance(old, dict):
            for key in new.keys() & old.keys():
                self._walk(new[key], old[key])
        elif isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
            for new_item, old_item in zip(new, old, strict=True):
                self._walk(new_item, old_item)


class JobRunner:
    """One job's run; ``kept`` are chunks an earlier runner stored (adoption)."""

    def __init__(
        self,
        store: JobStore,
        record: JobRecord,
        processor: StreamProcessor,
        events: AsyncIterator[InferenceEvent],
        *,
        done_marker: str | None,
        holder: str,
        kept: list[StoredChunk] | None = None,
    ) -> None:
        self.job_id = record.id
        self._store = store
        self._record = record
        self._processor = processor
        self._events = events
        self._done_marker = done_marker
        self._holder = holder
        self._kept = kept or []
        self._aligner = IdAligner()
        self._produced = 0  # chunks made so far, the kept ones included
        self._started = record.status is not JobStatus.QUEUED
        self._scope: anyio.CancelScope | None = None
        self.cancel_requested = False
        self.detached = False

    def cancel(self) -> None:
        """Stop the generation now (the backend cancels the request) and end as cancelled."""
        self.cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    @property
    def used_tokens(self) -> int:
        """The prompt and completion tokens of the generation so far."""
        return self._processor.usage.total_tokens

    def detach(self) -> None:
        """Stop writing and leave the generation running, for another runner to adopt."""
        self.detached = True

    async def run(self) -> None:
        try:
            outcome = await self._generate()
            if outcome is not None and not self.detached:
                await self._store.finish(self.job_id, outcome)
        except JobEnded:
            if await self._running_elsewhere():  # adopted meanwhile: leave it the generation
                self.detached = True
                await self._drain()
            else:
                log.info("job %s ended elsewhere (cancelled or expired)", self.job_id)
        except store_errors() as exc:  # the lease lapses and the job is adopted later
            log.warning("job %s: the store failed (%s); leaving it for adoption", self.job_id, exc)
            self.detached = True
            await self._drain()
        finally:
            with anyio.CancelScope(shield=True):
                close = getattr(self._events, "aclose", None)
                if close is not None:
                    await close()
                if not self.detached:
                    await self._release()

    async def _generate(self) -> JobOutcome | None:
        """Consume the events into chunks; the outcome, or None when detached."""
        processor = self._processor
        while not processor.done:
            event = await self._next()
            if self.detached:
                await self._drain()
                return None
            if event is None:
                break
            if isinstance(event, _Cancelled):
                if self._started:  # the stream ends like an aborted one; unstarted, it is empty
                    await self._write(processor.push(self._abort()))
                    await self._end_stream()
                return JobOutcome(JobStatus.CANCELLED, self._usage())
            if isinstance(event, Accepted):
                continue  # it may still wait in the engine: a job runs from its Ready
            await self._mark_running()
            await self._write(processor.push(event))
        await self._write(processor.finish())
        await self._end_stream()
        return self._outcome()

    async def _next(self) -> InferenceEvent | _Cancelled | None:
        """The next event, None at the end, or ``_CANCELLED`` once ``cancel`` was called."""
        if self.cancel_requested:
            return _CANCELLED
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                return await anext(self._events, None)
            finally:
                self._scope = None
        return _CANCELLED

    async def _running_elsewhere(self) -> bool:
        """After a refused append: another runner writes this job (not: it has ended)."""
        record = await self._store.get(self.job_id)
        return record is not None and not record.status.terminal

    async def _drain(self) -> None:
        """Read the events to their end without writing: nothing is cancelled."""
        async for _ in self._events:
            pass

    async def _mark_running(self) -> None:
        if not self._started:
            self._started = True
            await self._store.mark_running(self.job_id, time.time())

    async def _write(self, chunks: list[SSEChunk]) -> None:
        """Store the chunks not stored yet; the kept ones only teach the aligner."""
        if not self._record.events:
            return
        fresh: list[StoredChunk] = []
        for chunk in chunks:
            if self._produced < len(self._kept):
                self._aligner.learn(chunk, self._kept[self._produced])
            else:
                fresh.append(stored(self._aligner.chunk(chunk)))
            self._produced += 1
        if fresh and not self.detached:
            await self._store.append(self.job_id, self._produced - len(fresh) + 1, fresh)

    async def _end_stream(self) -> None:
        """Chat Completions' ``[DONE]`` closes any stream that said something."""
        if self._done_marker is not None and self._produced:
            await self._write([SSEChunk(self._done_marker)])

    def _abort(self) -> Finish:
        completion = self._processor.usage.completion_tokens
        return Finish(self._record.response_id, FinishReason.ABORT, completion)

    def _outcome(self) -> JobOutcome:
        error = self._processor.error
        if error is not None:
            return JobOutcome(JobStatus.FAILED, self._usage(), error=failure_of(error))
        result = self._aligner.apply(self._processor.response())
        return JobOutcome(JobStatus.COMPLETED, self._usage(), result=result)

    def _usage(self) -> dict[str, int]:
        return usage_of(self._processor)

    async def _release(self) -> None:
        try:
            await self._store.release(self.job_id, self._holder)
        except store_errors() as exc:  # it lapses on its own
            log.debug("releasing the lease of job %s failed: %s", self.job_id, exc)


def failure_of(error: ApiError) -> dict[str, Any]:
    """A failed job's ``error``: status, type, message, and ``retry_after`` (seconds) when the
    error said a retry may succeed."""
    failure: dict[str, Any] = {"status": error.status, "type": error.type, "message": error.message}
    if error.retry_after_s is not None:
        failure["retry_after"] = error.retry_after_s
    return failure


def usage_of(processor: StreamProcessor) -> dict[str, int]:
    """A job's usage, as its record keeps it."""
    usage = processor.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "cached_tokens": usage.cached_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
    }


__all__ = [
    "IdAligner",
    "JobRunner",
    "failure_of",
    "job_processor",
    "seeded_tool_call_ids",
    "stored",
    "usage_of",
]
