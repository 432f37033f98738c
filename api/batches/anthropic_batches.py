"""Anthropic's Message Batches: ``/v1/messages/batches``.

``POST`` takes ``requests``: ``[{"custom_id", "params"}]``, each ``params`` a
Messages body; they run as the batch's lines (``api.batches.service``). A
``params`` the Messages route would refuse errors that request alone.
``GET /{id}`` (``processing_status`` ``in_progress``, ``canceling``,
``ended``, and ``request_counts``), ``GET`` (newest first; ``after_id``,
``before_id``, ``limit``), ``POST /{id}/cancel``, ``DELETE /{id}`` (an ended
batch) and ``GET /{id}/results``: JSONL, one line per request in order,
``{"custom_id", "result": {"type": "succeeded", "message"} | {"type":
"errored", "error"} | {"type": "canceled"} | {"type": "expired"}}``. Times are
RFC 3339 strings, as Anthropic writes them. Errors take Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from api.auth import caller_name
from api.batches.files import KIND as FILE_KIND
from api.batches.files import Files
from api.batches.openai_batches import jsonl
from api.batches.service import Batches, Line, Outcome, refuse_unknown
from api.cursors import id_cursor
from api.errors import bad_request
from api.openapi_bodies import json_body
from api.protocols import messages
from api.protocols.messages_schema import CreateBody, Strict
from shared.heap import paused_collection

API = "anthropic"
MAX_REQUESTS = 100_000
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class BatchRequest(Strict):
    """One request of a batch: its ``custom_id`` names its result."""

    custom_id: Annotated[str, Field(pattern=f"^{CUSTOM_ID.pattern}$")]
    params: CreateBody = Field(description="A Messages request body (no stream).")


class MessageBatchCreate(Strict):
    """``POST /v1/messages/batches``: Messages requests to run, each named by its custom_id."""

    model_config = ConfigDict(
        extra="forbid",  # read_requests refuses any other field
        json_schema_extra={
            "examples": [
                {
                    "requests": [
                        {
                            "custom_id": "first",
                            "params": {
                                "model": "default",
                                "max_tokens": 256,
                                "messages": [{"role": "user", "content": "Hi"}],
                            },
                        }
                    ]
                }
            ]
        },
    )

    requests: Annotated[list[BatchRequest], Field(min_length=1, max_length=MAX_REQUESTS)]


def anthropic_batches_router(batches: Batches, files: Files, window_s: float) -> APIRouter:
    router = APIRouter(prefix=f"{messages.PROTOCOL.path}/batches")

    @router.post("", openapi_extra=json_body(MessageBatchCreate))
    async def create(request: Request) -> Response:
        now = int(time.time())
        record = {
            "id": "msgbatch_" + secrets.token_hex(12),
            "api": API,
            "created_at": now,
            "expires_at": now + int(window_s),
            "owner": caller_name(request),
        }
        # Up to 100,000 requests' objects, alive until the batch is saved and freed before the
        # collector resumes (it would walk every one of them once more).
        with paused_collection():
            body = await batches.manager.serving.read_json(request)
            lines = await batches.manager.serving.off_loop(read_requests, body)
            created = await batches.create(record, lines)
            del body, lines
        return JSONResponse(view(created, request))

    @router.get("")
    async def list_batches(
        request: Request,
        limit: int = 20,
        after_id: str | None = None,
        before_id: str | None = None,
    ) -> Response:
        if not 1 <= limit <= 1000:
            raise bad_request(f"limit must be between 1 and 1000, got {limit}", "limit")
        owner = caller_name(request)
        if before_id is None or after_id is not None:
            after = id_cursor(after_id, "after_id")
            page, more = await batches.list(owner, API, limit, after)
        else:  # the page just newer than before_id: read upwards from it, shown newest first
            before = id_cursor(before_id, "before_id")
            page, more = await batches.list(owner, API, limit, before, ascending=True)
            page.reverse()
        data = [view(record, request) for record in page]
        return JSONResponse(
            {
                "data": data,
                "has_more": more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )

    @router.get("/{batch_id}")
    async def retrieve(batch_id: str, request: Request) -> Response:
        return JSONResponse(view(await batches.get(batch_id, caller_name(request), API), request))

    @router.post("/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> Response:
        return JSONResponse(
            view(await batches.cancel(batch_id, caller_name(request), API), request)
        )

    @router.delete("/{batch_id}")
    async def delete(batch_id: str, request: Request) -> Response:
        owner = caller_name(request)
        record = await batches.delete(batch_id, owner, API)
        if record.get("results_file_id") is not None:  # the results go with their batch
            await files.objects.delete(FILE_KIND, record["results_file_id"])
        return JSONResponse({"id": batch_id, "type": "message_batch_deleted"})

    @router.get("/{batch_id}/results")
    async def results(batch_id: str, request: Request) -> Response:
        owner = caller_name(request)
        record = await batches.get(batch_id, owner, API)
        if record.get("results_file_id") is None:
            raise bad_request(
                f"Batch {batch_id!r} has not ended ({record['status']}): its results are not "
                "available yet",
                "batch_id",
            )
        content = await files.content(record["results_file_id"], owner)
        return Response(content, media_type="application/binary")

    return router


def read_requests(body: dict[str, Any]) -> list[Line]:
    """The batch's requests; a 400 naming the first malformed one."""
    refuse_unknown(body, ("requests",))
    requests = body.get("requests")
    if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_REQUESTS:
        raise bad_request(f"requests must be a list of 1 to {MAX_REQUESTS} requests", "requests")
    lines, seen = [], set()
    for index, item in enumerate(requests):
        where = f"requests[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise bad_request(
                f"{where}.custom_id must be 1 to 64 letters, digits, '-' or '_', got {custom_id!r}",
                f"{where}.custom_id",
            )
        if custom_id in seen:
            raise bad_request(
                f"{where}.custom_id {custom_id!r} is used twice", f"{where}.custom_id"
            )
        if not isinstance(item.get("params"), dict):
            raise bad_request(f"{where}.params must be a Messages request body", f"{where}.params")
        if item["params"].get("stream"):
            raise bad_request(f"{where}.params.stream is not supported in a batch", where)
        seen.add(custom_id)
        lines.append(Line(custom_id, messages.PROTOCOL.path, item["params"]))
    return lines


def view(record: dict[str, Any], request: Request) -> dict[str, Any]:
    """The message batch object as Anthropic shapes it."""
    status = record["status"]
    ended = status in ("completed", "cancelled", "expired", "failed")
    ended_at = record.get("completed_at") or record.get("cancelled_at") or record.get("expired_at")
    results_url = None
    if ended:
        results_url = str(request.url_for("results", batch_id=record["id"]))
    return {
        "id": record["id"],
        "type": "message_batch",
        "processing_status": "ended" if ended else _PROCESSING.get(status, "in_progress"),
        "request_counts": {
            name: record["counts"].get(name, 0)
            for name in ("processing", "succeeded", "errored", "canceled", "expired")
        },
        "ended_at": _time(ended_at if ended else None),
        "created_at": _time(record["created_at"]),
        "expires_at": _time(record["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": _time(record.get("cancelling_at")),
        "results_url": results_url,
    }


_PROCESSING = {"in_progress": "in_progress", "cancelling": "canceling", "finalizing": "in_progress"}


def results_finalizer(files: Files):  # noqa: ANN201
    """Writes a finished batch's results as a file; returns its id for the record."""

    async def finalize(
        record: dict[str, Any], outcomes: AsyncIterator[list[Outcome]]
    ) -> dict[str, Any]:
        pieces = [await asyncio.to_thread(_results, part) async for part in outcomes]
        saved = await files.create(
            b"".join(pieces), f"{record['id']}_results.jsonl", "batch_output",
            record.get("owner"), charged=False,
        )  # fmt: skip
        return {"results_file_id": saved["id"]}

    return finalize


def _results(outcomes: list[Outcome]) -> bytes:
    """The results file: one line per request, in order."""
    return jsonl([{"custom_id": o.custom_id, "result": _result(o)} for o in outcomes])


def _result(outcome: Outcome) -> dict[str, Any]:
    if outcome.kind == "succeeded":
        return {"type": "succeeded", "message": outcome.body}
    if outcome.kind == "errored":
        error = (outcome.body or {}).get("error") or {}
        detail = {
            "type": error.get("type") or "api_error",
            "message": error.get("message", ""),
        }
        return {"type": "errored", "error": {"type": "error", "error": detail}}
    return {"type": outcome.kind}


def _time(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


__all__ = ["anthropic_batches_router", "read_requests", "results_finalizer", "view"]
