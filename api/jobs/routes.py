"""The jobs API: submit now, fetch or stream later, resume after a reconnect, cancel.

- ``POST /v1/jobs`` ``{"endpoint", "body", "metadata"}`` → 202 and the job;
  ``POST /v1/jobs/batch`` takes a list of those (bare, or as ``{"jobs": [...]}``)
  and answers the jobs in the same order. A body the synchronous endpoint would
  refuse is refused here, with the same status and in that protocol's error
  shape; in a batch one refused body queues nothing.
- ``GET /v1/jobs/{id}`` → the job: status, timestamps, usage and, once
  completed, ``result``: the synchronous non-stream response.
- ``GET /v1/jobs/{id}/events`` → the protocol's stream as SSE from the
  beginning (live while the job runs); every event has an ``id:``, and
  ``Last-Event-ID`` (or ``?after=``) resumes after that event.
- ``DELETE /v1/jobs/{id}`` cancels; ``GET /v1/jobs?status=&limit=&after=`` lists.

Errors that are not about a job body (unknown job, bad envelope) answer in
OpenAI's shape, like every path outside the protocol table. Jobs belong to
the API key that submitted them once authentication sets
``request.state.api_key``; until then every job is everyone's. A job is held
to its key's models, priority, requests and tokens per minute (a 429 when
over; in a batch, one refused job queues nothing), but takes none of the key's
places at once: it holds no connection, and the server's queue bounds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, RootModel
from sse_starlette import ServerSentEvent

from api.auth import caller_key, caller_name
from api.cursors import event_cursor, id_cursor
from api.errors import ApiError, bad_request
from api.jobs.manager import JobManager, JobRequest, SubmitError
from api.jobs.records import JobRecord, JobStatus, StoredChunk, read_metadata
from api.openapi_bodies import json_body
from api.protocols.base import Protocol
from api.protocols.openai_request_parts import Metadata, OpenBody
from api.sse import SSEResponse

if TYPE_CHECKING:
    from api.auth import ApiKey
    from api.settings import Settings

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
_EXAMPLE = {
    "endpoint": "/v1/chat/completions",
    "body": {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
}


class JobSubmission(OpenBody):
    """``POST /v1/jobs``: a body for a generation endpoint, run later."""

    model_config = ConfigDict(json_schema_extra={"examples": [_EXAMPLE]})

    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
    body: dict[str, Any] = Field(description="The request body that endpoint takes.")
    metadata: Metadata | None = None


class JobList(OpenBody):
    jobs: Annotated[list[JobSubmission], Field(min_length=1)]


class JobBatch(RootModel[JobList | Annotated[list[JobSubmission], Field(min_length=1)]]):
    """``POST /v1/jobs/batch``: jobs as ``{"jobs": [...]}`` or a bare array; all or none."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"jobs": [_EXAMPLE]}]})


def jobs_router(manager: JobManager, settings: Settings) -> APIRouter:
    """The routes; the manager's lifespan is the router's (it closes the manager's store).

    A Responses body's ``previous_response_id`` is resolved as ``POST /v1/responses`` does
    (the manager's resolvers).
    """
    protocols, serving = manager.protocols, manager.serving
    router = APIRouter(prefix="/v1/jobs", lifespan=manager.lifespan)

    @router.post("", openapi_extra=json_body(JobSubmission))
    async def submit_job(request: Request) -> Response:
        jobs = [_job_request(await serving.read_json(request), protocols, "")]
        return await _submitted(manager, jobs, caller_key(request), batch=False)

    @router.post("/batch", openapi_extra=json_body(JobBatch))
    async def submit_jobs(request: Request) -> Response:
        items = _batch_items(await serving.read_json(request, value=True), settings.max_batch_jobs)
        jobs = [_job_request(item, protocols, f"jobs[{i}].") for i, item in enumerate(items)]
        return await _submitted(manager, jobs, caller_key(request), batch=True)

    @router.get("")
    async def list_jobs(
        request: Request,
        status: str | None = None,
        limit: int = DEFAULT_LIST_LIMIT,
        after: str | None = None,
    ) -> Response:
        wanted, limit, after = _status(status), _limit(limit), id_cursor(after, "after")
        records, more = await manager.list(caller_name(request), wanted, limit, after)
        return JSONResponse(_page(records, more))

    @router.get("/{job_id}")
    async def get_job(job_id: str, request: Request) -> Response:
        return JSONResponse((await manager.get(job_id, caller_name(request))).view())

    @router.get("/{job_id}/events")
    async def job_events(job_id: str, request: Request, after: str | None = None) -> Response:
        header = request.headers.get("last-event-id")
        start = event_cursor(*((after, "after") if header is None else (header, "Last-Event-ID")))
        chunks = await manager.events(job_id, caller_name(request), start)
        return SSEResponse(_sse(chunks), sep="\n")

    @router.delete("/{job_id}")
    async def cancel_job(job_id: str, request: Request) -> Response:
        return JSONResponse((await manager.cancel(job_id, caller_name(request))).view())

    return router


async def _submitted(
    manager: JobManager, jobs: list[JobRequest], key: ApiKey | None, *, batch: bool
) -> Response:
    """202 with the jobs, or the refused body's error in its protocol's shape."""
    try:
        records = await manager.submit(jobs, key)
    except SubmitError as exc:
        error = exc.error
        if batch:
            error.message = f"jobs[{exc.index}].body: {error.message}"
            error.param = f"jobs[{exc.index}].body.{error.param}" if error.param else None
        body = exc.protocol.error_body(error)
        return JSONResponse(body, status_code=error.status, headers=error.headers)
    if batch:
        data = [record.view() for record in records]
        return JSONResponse({"object": "list", "data": data}, status_code=202)
    return JSONResponse(records[0].view(), status_code=202)


def _job_request(item: Any, protocols: dict[str, Protocol], where: str) -> JobRequest:
    """``{"endpoint", "body", "metadata"}``; 400s name the field."""
    if not isinstance(item, dict):
        raise bad_request(f"{where or 'the job'} must be an object, got {type(item).__name__}")
    endpoint = item.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in protocols:
        accepted = ", ".join(repr(path) for path in protocols)
        raise bad_request(
            f"{where}endpoint must be one of {accepted}, got {endpoint!r}", f"{where}endpoint"
        )
    body = item.get("body")
    if not isinstance(body, dict):
        raise bad_request(
            f"{where}body must be the request body (an object), got {type(body).__name__}",
            f"{where}body",
        )
    try:
        metadata = read_metadata(item.get("metadata"))
    except ApiError as exc:
        raise bad_request(where + exc.message, where + (exc.param or "metadata")) from None
    return JobRequest(protocols[endpoint], body, metadata)


def _batch_items(body: Any, most: int) -> list[Any]:
    """A bare JSON array of jobs, or ``{"jobs": [...]}``; between 1 and ``most`` of them."""
    items = body.get("jobs") if isinstance(body, dict) else body
    if not isinstance(items, list) or not 1 <= len(items) <= most:
        count = len(items) if isinstance(items, list) else type(items).__name__
        raise bad_request(f"jobs must be a list of 1 to {most} jobs, got {count}", "jobs")
    return items


def _status(value: str | None) -> JobStatus | None:
    if value is None:
        return None
    try:
        return JobStatus(value)
    except ValueError:
        accepted = ", ".join(status.value for status in JobStatus)
        raise bad_request(f"status must be one of {accepted}, got {value!r}", "status") from None


def _limit(value: int) -> int:
    if not 1 <= value <= MAX_LIST_LIMIT:
        raise bad_request(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {value}", "limit")
    return value


def _page(records: list[JobRecord], more: bool) -> dict[str, Any]:
    """OpenAI's list shape; results are left out (fetch the job for its result)."""
    return {
        "object": "list",
        "data": [record.view(with_result=False) for record in records],
        "first_id": records[0].id if records else None,
        "last_id": records[-1].id if records else None,
        "has_more": more,
    }


async def _sse(chunks: AsyncIterator[tuple[int, StoredChunk]]) -> AsyncIterator[ServerSentEvent]:
    async for index, chunk in chunks:
        yield ServerSentEvent(data=chunk.data, event=chunk.event, id=str(index))


__all__ = ["jobs_router"]
