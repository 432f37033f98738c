"""Stored and background responses: the Responses API's view of jobs.

A stored response is a job of the endpoint ``/v1/responses`` whose id shares
its random part with the response's (``resp_<hex>`` is the job
``job_<hex>``), so everything jobs have, responses have: a record every API
replica sees (Redis in distributed mode), retention, ownership by the API key
that created it, cancellation, and an event stream numbered from 1, which for
a response is its ``sequence_number`` plus one.

- ``background: true`` submits the body as a job and answers at once with the
  response ``queued``; ``GET /v1/responses/{id}`` then says ``queued``,
  ``in_progress``, and finally the response itself (``completed`` or
  ``incomplete``), ``failed`` or ``cancelled``.
- A foreground response with ``store`` (true unless false) runs as before and
  is saved, finished, once its last byte is sent. A ``/v1/jobs`` job of this
  endpoint whose body says ``store: false`` is a job only: the Responses routes
  and ``previous_response_id`` do not find it.
- ``previous_response_id`` is resolved before parsing: the stored response's
  input (itself resolved when it was stored) and output become the start of
  ``input``. Its instructions are not carried over, as OpenAI's are not. The
  new prompt starts with the old one and its answer, so the prefix cache
  serves them and usage reports them as cached input tokens.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from api.auth import caller_name
from api.batches.files import list_page
from api.cursors import event_cursor, id_cursor
from api.errors import ApiError, bad_request
from api.jobs.manager import JobManager, JobRequest, SubmitError
from api.jobs.records import JobOutcome, JobRecord, JobStatus
from api.jobs.runner import usage_of
from api.protocols import responses
from api.protocols.base import ResponseContext
from api.sse import SSEResponse

if TYPE_CHECKING:
    from api.auth import ApiKey
    from api.preparation import Prepared
    from api.streaming import StreamProcessor

PATH = responses.PROTOCOL.path
PREFIX = responses.PROTOCOL.id_prefix
_STATUSES = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "in_progress",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
}


class StoredResponses:
    """Keeps, queues, reads, cancels and deletes responses through the job manager."""

    def __init__(self, manager: JobManager) -> None:
        self.manager = manager
        manager.resolvers[PATH] = self.resolve_previous  # jobs and batch lines resolve it too

    async def resolve_previous(self, body: Any, owner: str | None) -> Any:
        """``body`` with the stored conversation of ``previous_response_id`` before its input."""
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("previous_response_id"), str)
            or not isinstance(body.get("input"), str | list)
        ):
            return body  # nothing to resolve, or a malformed value that parsing names
        previous_id = body["previous_response_id"]
        record = await self._record(previous_id, owner, param="previous_response_id")
        if record.status is not JobStatus.COMPLETED or record.result is None:
            raise bad_request(
                f"Previous response {previous_id!r} is {_STATUSES.get(record.status, 'gone')}: "
                "only a finished response can be continued",
                "previous_response_id",
            )
        history = _items(record.body.get("input")) + record.result["output"]
        return {**body, "input": history + _items(body.get("input"))}

    async def submit_background(self, body: dict[str, Any], key: ApiKey | None) -> Response:
        """Queue the response as a job; 200 with the response ``queued``, or with ``stream``
        its events from the first, as a later retrieve with ``stream`` gives them."""
        try:
            (record,) = await self.manager.submit([JobRequest(responses.PROTOCOL, body, {})], key)
        except SubmitError as exc:
            error = exc.error
            return JSONResponse(
                responses.PROTOCOL.error_body(error), error.status, headers=error.headers
            )
        if body.get("stream") is True:
            owner = key.name if key is not None else None
            return SSEResponse(await self.events(record.response_id, owner, None), sep="\n")
        return JSONResponse(self.view(record))

    async def keep(
        self, prepared: Prepared, processor: StreamProcessor, body: dict, owner: str | None
    ) -> None:
        """Save a foreground response that ended well, finished, under its own id."""
        if not processor.done or processor.error is not None:
            return
        store, now = self.manager.store, time.time()
        response_id = prepared.context.request_id
        record = JobRecord(
            id=_job_id(response_id),
            endpoint=PATH,
            body=body,
            metadata={},
            owner=owner,
            response_id=response_id,
            response_created=prepared.context.created,
            created_at=now,
            expires_at=now + store.retention_s,
            started_at=now,
        )
        await store.create(record, self.manager.holder)
        outcome = JobOutcome(
            JobStatus.COMPLETED, usage_of(processor), result=processor.response(), finished_at=now
        )
        await store.finish(record.id, outcome)

    def view(self, record: JobRecord) -> dict[str, Any]:
        """The response object: the result once finished, else the request's echo and status."""
        if record.status is JobStatus.COMPLETED and record.result is not None:
            return record.result
        request = responses.PROTOCOL.parse(record.body)
        context = ResponseContext(record.response_id, request.model, record.response_created, "")
        body = responses.PROTOCOL.builder(request, context).response()
        body["status"] = _STATUSES[record.status]
        if record.error is not None:
            body["error"] = {"code": "server_error", "message": record.error.get("message", "")}
        return body

    async def get(self, response_id: str, owner: str | None) -> JobRecord:
        return await self._record(response_id, owner)

    async def events(
        self, response_id: str, owner: str | None, starting_after: str | None
    ) -> AsyncIterator[ServerSentEvent]:
        """The background response's events after sequence number ``starting_after``."""
        record = await self._background(response_id, owner, "streamed again", "stream")
        after = event_cursor(starting_after, "starting_after") + 1 if starting_after else 0
        chunks = await self.manager.events(record.id, owner, after)

        async def sse() -> AsyncIterator[ServerSentEvent]:
            async for index, chunk in chunks:
                yield ServerSentEvent(data=chunk.data, event=chunk.event, id=str(index - 1))

        return sse()

    async def cancel(self, response_id: str, owner: str | None) -> dict[str, Any]:
        record = await self._background(response_id, owner, "cancelled", "response_id")
        return self.view(await self.manager.cancel(record.id, owner))

    async def delete(self, response_id: str, owner: str | None) -> dict[str, Any]:
        record = await self._record(response_id, owner)
        if not record.status.terminal:
            await self.manager.cancel(record.id, owner)
        await self.manager.store.delete(record.id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _background(
        self, response_id: str, owner: str | None, what: str, param: str
    ) -> JobRecord:
        """The response's job, or a 400 when it was not created in the background."""
        record = await self._record(response_id, owner)
        if not record.body.get("background"):
            raise bad_request(
                f"Response {response_id!r} was not created with background true: only "
                f"background responses can be {what}",
                param,
            )
        return record

    async def _record(
        self, response_id: str, owner: str | None, param: str = "response_id"
    ) -> JobRecord:
        """The stored response's job, or a 404 that names it."""
        missing = ApiError(
            404,
            f"Response with id {response_id!r} not found.",
            "invalid_request_error",
            param,
            "response_not_found",
        )
        if not response_id.startswith(PREFIX):
            raise missing
        try:
            record = await self.manager.get(_job_id(response_id), owner)
        except ApiError:
            raise missing from None
        if record.endpoint != PATH or record.status is JobStatus.EXPIRED:
            raise missing
        if record.body.get("store") is False:  # a job of /v1/jobs that asked not to be stored
            raise missing
        return record


def responses_router(stored: StoredResponses) -> APIRouter:
    """``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
    ``POST /v1/responses/{id}/cancel``."""
    router = APIRouter(prefix=PATH)

    @router.get("/{response_id}")
    async def retrieve(
        response_id: str,
        request: Request,
        stream: bool = False,
        starting_after: str | None = None,
    ) -> Response:
        owner = caller_name(request)
        if stream:
            events = await stored.events(response_id, owner, starting_after)
            return SSEResponse(events, sep="\n")
        return JSONResponse(stored.view(await stored.get(response_id, owner)))

    @router.get("/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        after: str | None = None,
        limit: int = 20,
        order: str = "desc",
        include: list[str] | None = Query(None),  # noqa: B008 (FastAPI's way to read a list)
    ) -> Response:
        if include:
            raise bad_request(f"include {include!r} is not supported here", "include")
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            raise bad_request("limit must be 1 to 100 and order 'asc' or 'desc'", "limit")
        after = id_cursor(after, "after")
        record = await stored.get(response_id, caller_name(request))
        items = input_items_of(record)
        if order == "desc":
            items.reverse()
        ids = [item["id"] for item in items]
        if after is not None:
            items = items[ids.index(after) + 1 :] if after in ids else []
        return JSONResponse(list_page(items[:limit], len(items) > limit))

    @router.post("/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Response:
        return JSONResponse(await stored.cancel(response_id, caller_name(request)))

    @router.delete("/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        return JSONResponse(await stored.delete(response_id, caller_name(request)))

    return router


def input_items_of(record: JobRecord) -> list[dict[str, Any]]:
    """The items the response was made from (a continued one's history first), in order.

    Each has an id (its own, or one derived from the response's id and its place) and
    its text as content parts, as OpenAI lists them.
    """
    items = []
    for index, item in enumerate(_items(record.body.get("input"))):
        shown = dict(item) if isinstance(item, dict) else {}
        kind = shown.setdefault("type", "message")
        if isinstance(shown.get("content"), str):
            part = "output_text" if shown.get("role") == "assistant" else "input_text"
            shown["content"] = [{"type": part, "text": shown["content"]}]
        if "id" not in shown:
            digest = hashlib.sha256(f"{record.response_id}:{index}".encode()).hexdigest()
            shown["id"] = f"{_ITEM_PREFIXES.get(kind, 'item')}_{digest[:32]}"
        shown.setdefault("status", "completed")
        items.append(shown)
    return items


_ITEM_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _items(value: Any) -> list[Any]:
    """``input`` as a list of items: a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


def _job_id(response_id: str) -> str:
    return "job_" + response_id.removeprefix(PREFIX)


__all__ = ["StoredResponses", "responses_router"]
