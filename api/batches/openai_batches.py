"""OpenAI's Batch API: ``/v1/batches``.

``POST /v1/batches`` takes ``input_file_id`` (a JSONL file of
``{"custom_id", "method": "POST", "url", "body"}`` lines), ``endpoint``
(``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``, the
``url`` of every line), ``completion_window`` (``24h``), ``metadata`` and ``output_expires_after``
(when the output and error files expire). A
file that is not such JSONL gives a batch with status ``failed`` whose
``errors`` name each bad line by number; otherwise the batch runs
(``api.batches.service``). ``GET /v1/batches/{id}``, ``GET /v1/batches``
(newest first, ``after``, ``limit``) and ``POST /v1/batches/{id}/cancel``.

Output and error files are JSONL in OpenAI's format, one line per request in
input order: ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``. A request the endpoint refused (a 400 for its body) or
that failed is in the error file; ``request_counts.failed`` counts those,
``completed`` the output file's lines.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from api.auth import caller_name
from api.batches.files import ExpiresAfter, Files, expiry_seconds, list_page
from api.batches.service import Batches, Line, Outcome, refuse_unknown
from api.cursors import id_cursor
from api.errors import bad_request
from api.jobs.records import read_metadata
from api.openapi_bodies import json_body
from api.protocols.openai_request_parts import ClosedBody, Metadata
from shared.heap import paused_collection

API = "openai"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_LINES = 50_000
CREATE_FIELDS = (
    "input_file_id",
    "endpoint",
    "completion_window",
    "metadata",
    "output_expires_after",
)
MAX_LINE_ERRORS = 20
_FAILED = ("errored", "expired")  # the outcomes the error file holds
_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class BatchCreate(ClosedBody):
    """``POST /v1/batches``: run every request of an uploaded JSONL file."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "input_file_id": "file-abc123",
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                }
            ]
        }
    )

    input_file_id: str = Field(description="A file uploaded with purpose 'batch'.")
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None


def openai_batches_router(batches: Batches, files: Files, window_s: float) -> APIRouter:
    """The routes; a batch's requests that have not ended ``window_s`` after it was created
    expire (OpenAI's 24 h ``completion_window``; ``--batch-completion-window`` sets it)."""
    router = APIRouter(prefix="/v1/batches")

    @router.post("", openapi_extra=json_body(BatchCreate))
    async def create(request: Request) -> Response:
        body = await batches.manager.serving.read_json(request)
        refuse_unknown(body, CREATE_FIELDS)
        owner = caller_name(request)
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            accepted = ", ".join(ENDPOINTS)
            raise bad_request(f"endpoint must be one of {accepted}, got {endpoint!r}", "endpoint")
        if body.get("completion_window") != "24h":
            raise bad_request(
                f"completion_window must be '24h', got {body.get('completion_window')!r}",
                "completion_window",
            )
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad_request("input_file_id is required (a file id)", "input_file_id")
        content = await files.content(file_id, owner)
        now = int(time.time())
        record: dict[str, Any] = {
            "id": "batch_" + secrets.token_hex(12),
            "object": "batch",
            "api": API,
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": "24h",
            "created_at": now,
            "expires_at": now + int(window_s),
            "metadata": read_metadata(body.get("metadata")),
            "owner": owner,
            "errors": None,
            "output_file_id": None,
            "error_file_id": None,
            "output_expiry_s": expiry_seconds(
                body.get("output_expires_after"), "output_expires_after"
            ),
        }
        # Up to 50,000 requests' objects, alive until the batch is saved and freed before the
        # collector resumes (it would walk every one of them once more).
        with paused_collection():
            lines, errors = await batches.manager.serving.off_loop(read_lines, content, endpoint)
            created = None if errors else await batches.create(record, lines)
            del lines
        if created is not None:
            return JSONResponse(view(created))
        record.update(status="failed", failed_at=now, total=0, counts={}, errors=errors)
        record["kept_until"] = record["expires_at"] + batches.retention_s
        await batches.objects.put("batch", record["id"], record)
        return JSONResponse(view(record))

    @router.get("")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> Response:
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
        after = id_cursor(after, "after")
        records, more = await batches.list(caller_name(request), API, limit, after)
        return JSONResponse(list_page([view(record) for record in records], more))

    @router.get("/{batch_id}")
    async def retrieve(batch_id: str, request: Request) -> Response:
        return JSONResponse(view(await batches.get(batch_id, caller_name(request), API)))

    @router.post("/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> Response:
        return JSONResponse(view(await batches.cancel(batch_id, caller_name(request), API)))

    return router


def read_lines(content: bytes, endpoint: str) -> tuple[list[Line], dict[str, Any] | None]:
    """The file's requests, or the ``errors`` object naming its bad lines (1-based)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        text, errors = "", [_error("invalid_json", "the file is not UTF-8 text", None)]
    # JSON lines end at "\n" (or "\r\n") only: U+2028, U+0085 and the like are characters
    # a JSON string may hold raw, where str.splitlines() would cut the line.
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        problem = _line_problem(raw, endpoint, seen)
        if isinstance(problem, Line):
            lines.append(problem)
            seen.add(problem.custom_id)
        else:
            errors.append(_error(*problem, number))
    if not lines and not errors:
        errors.append(_error("empty_file", "the input file holds no request", None))
    if len(lines) > MAX_LINES:
        errors.append(_error("too_many_requests", f"at most {MAX_LINES} requests", None))
    if not errors:
        return lines, None
    return [], {"object": "list", "data": errors[:MAX_LINE_ERRORS]}


def _line_problem(raw: str, endpoint: str, seen: set[str]) -> Line | tuple[str, str, str | None]:
    try:
        item = json.loads(raw)
    except ValueError:
        return "invalid_json", "the line is not JSON", None
    if not isinstance(item, dict):
        return "invalid_request", "the line must be a JSON object", None
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "custom_id must be a non-empty string", "custom_id"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id!r} is used twice", "custom_id"
    if item.get("method") != "POST":
        return "invalid_request", f"method must be 'POST', got {item.get('method')!r}", "method"
    if item.get("url") != endpoint:
        return (
            "mismatched_url",
            f"url must be the batch's endpoint {endpoint!r}, got {item.get('url')!r}",
            "url",
        )
    if not isinstance(item.get("body"), dict):
        return "missing_required_parameter", "body must be the request body (an object)", "body"
    return Line(custom_id, endpoint, item["body"])


def _error(code: str, message: str, param: str | None, line: int | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def view(record: dict[str, Any]) -> dict[str, Any]:
    """The batch object as OpenAI shapes it."""
    counts = record.get("counts") or {}
    failed = counts.get("errored", 0) + counts.get("expired", 0)
    shown = {
        "id": record["id"],
        "object": "batch",
        "endpoint": record["endpoint"],
        "errors": record.get("errors"),
        "input_file_id": record["input_file_id"],
        "completion_window": record["completion_window"],
        "status": record["status"],
        "output_file_id": record.get("output_file_id"),
        "error_file_id": record.get("error_file_id"),
        "created_at": record["created_at"],
        "expires_at": record["expires_at"],
        "request_counts": {
            "total": record.get("total", 0),
            "completed": counts.get("succeeded", 0),
            "failed": failed,
        },
        "metadata": record.get("metadata") or None,
    }
    shown.update({name: record.get(name) for name in _TIMES})
    return shown


def output_finalizer(files: Files):  # noqa: ANN201
    """Writes a finished batch's output and error files; returns their ids for its record."""

    async def finalize(
        record: dict[str, Any], outcomes: AsyncIterator[list[Outcome]]
    ) -> dict[str, Any]:
        parts: dict[str, list[bytes]] = {"output_file_id": [], "error_file_id": []}
        async for part in outcomes:
            for name, kinds in (("output_file_id", ("succeeded",)), ("error_file_id", _FAILED)):
                chosen = [outcome for outcome in part if outcome.kind in kinds]
                if chosen:
                    parts[name].append(await asyncio.to_thread(_output, chosen))
        ids: dict[str, Any] = {}
        for name, pieces in parts.items():
            if pieces:
                filename = f"{record['id']}_{name.removesuffix('_file_id')}.jsonl"
                saved = await files.create(
                    b"".join(pieces),
                    filename,
                    "batch_output",
                    record.get("owner"),
                    record.get("output_expiry_s"),
                    charged=False,
                )
                ids[name] = saved["id"]
        return ids

    return finalize


def jsonl(items: list[dict[str, Any]]) -> bytes:
    """JSON lines, one dump each (a thread writing many lets the event loop run between)."""
    return "".join(json.dumps(item) + "\n" for item in items).encode()


def _output(outcomes: list[Outcome]) -> bytes:
    """An output or error file: one line per request, in order."""
    return jsonl([_output_line(outcome) for outcome in outcomes])


def _output_line(outcome: Outcome) -> dict[str, Any]:
    response = None
    if outcome.status_code is not None:
        response = {
            "status_code": outcome.status_code,
            "request_id": outcome.response_id,
            "body": outcome.body,
        }
    error = None
    if outcome.kind == "expired":
        error = {"code": "batch_expired", "message": "the batch ended before this request ran"}
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": outcome.custom_id,
        "response": response,
        "error": error,
    }


__all__ = ["jsonl", "openai_batches_router", "output_finalizer", "read_lines", "view"]
