"""OpenAI's Files API, for batch input and output: ``/v1/files``.

- ``POST /v1/files`` (multipart: ``file``, ``purpose`` ``batch``, optional
  ``expires_after[anchor]`` ``created_at`` and ``expires_after[seconds]``)
  → the file object. A file over ``--max-file-bytes`` is a 413 naming the
  limit; one that would take its key past ``--max-file-bytes-per-key`` or
  ``--max-files-per-key`` is too.
- ``GET /v1/files`` (``purpose``, ``limit``, ``after``, ``order``: newest first
  unless ``asc``),
  ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.

Files expire after ``expires_after`` seconds (1 hour to 30 days, as OpenAI
allows), by default after the job retention. Batch output and error files are
written here too (purpose ``batch_output``), owned by the batch's key and not
charged to its quota.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.datastructures import UploadFile

from api.auth import caller_name
from api.batches.objects import ObjectStore, Quota, QuotaExceeded, visible
from api.cursors import id_cursor
from api.errors import ApiError, bad_request
from api.openapi_bodies import form_body
from api.protocols.openai_request_parts import OpenBody
from api.request_body import read_body

KIND = "file"
PURPOSES = ("batch",)
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86_400
ExpirySeconds = Annotated[int, Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)]


class ExpiresAfter(OpenBody):
    """When a file expires: ``seconds`` after it was created."""

    anchor: Literal["created_at"]
    seconds: ExpirySeconds


class FileUpload(OpenBody):
    """``POST /v1/files``: a JSONL file of batch requests, as ``multipart/form-data``."""

    file: bytes = Field(description="The file's content.")
    purpose: Literal["batch"]
    expires_after_anchor: Literal["created_at"] | None = Field(None, alias="expires_after[anchor]")
    expires_after_seconds: ExpirySeconds | None = Field(None, alias="expires_after[seconds]")


MULTIPART_OVERHEAD = 64 * 1024  # headers and boundaries around the file's bytes
DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT = 20, 10_000


class Files:
    """Files of one server, with its limits; the batch machinery reads and writes them too.

    A key's uploads are charged to it: ``max_bytes_per_key`` and ``max_files_per_key``
    bound what they hold together. A batch's output is not charged: the server writes
    it whatever the key holds (the batch was accepted), and it expires as asked.
    """

    def __init__(
        self,
        objects: ObjectStore,
        *,
        max_file_bytes: int,
        max_bytes_per_key: int,
        max_files_per_key: int,
        default_expiry_s: float,
        body_timeout_s: float,
    ) -> None:
        self.objects = objects
        self.max_file_bytes = max_file_bytes
        self.quota = Quota(max_bytes_per_key, max_files_per_key)
        self.default_expiry_s = default_expiry_s
        self.body_timeout_s = body_timeout_s

    async def create(
        self,
        content: bytes,
        filename: str,
        purpose: str,
        owner: str | None,
        expiry_s: float | None = None,
        *,
        charged: bool = True,
    ) -> dict[str, Any]:
        """Save ``content``; 413 over the file limit or the key's quota (unless not
        ``charged``: a batch's output)."""
        if charged and len(content) > self.max_file_bytes:
            raise _too_large(
                f"The file is {len(content)} bytes; files may hold at most "
                f"{self.max_file_bytes} bytes (--max-file-bytes)"
            )
        now = int(time.time())
        record = {
            "id": "file-" + secrets.token_hex(12),
            "object": "file",
            "bytes": len(content),
            "created_at": now,
            "expires_at": now + int(expiry_s or self.default_expiry_s),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "owner": owner,
        }
        record["kept_until"] = record["expires_at"]
        try:
            await self.objects.put(
                KIND, record["id"], record, content, self.quota if charged else None
            )
        except QuotaExceeded as exc:
            raise _over_quota(exc) from None
        return record

    async def get(self, file_id: str, owner: str | None) -> dict[str, Any]:
        record = await self.objects.get(KIND, file_id)
        if record is None or not visible(record, owner):
            raise ApiError(
                404, f"No such File object: {file_id}", "invalid_request_error", "file_id"
            )
        return record

    async def content(self, file_id: str, owner: str | None) -> bytes:
        await self.get(file_id, owner)
        return await self.objects.blob(KIND, file_id) or b""

    async def delete(self, file_id: str, owner: str | None) -> dict[str, Any]:
        await self.get(file_id, owner)
        await self.objects.delete(KIND, file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def files_router(files: Files) -> APIRouter:
    router = APIRouter(prefix="/v1/files")

    @router.post("", openapi_extra=form_body(FileUpload))
    async def upload(request: Request) -> Response:
        limit = files.max_file_bytes + MULTIPART_OVERHEAD
        try:
            raw = await read_body(request, limit, files.body_timeout_s)
        except ApiError as exc:
            if exc.status == 413:
                raise _too_large(
                    f"The upload passed {limit} bytes; files may hold at most "
                    f"{files.max_file_bytes} bytes (--max-file-bytes)"
                ) from None
            raise
        form = await _form(request, raw)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("file is required: send it as a multipart/form-data part", "file")
        purpose = form.get("purpose")
        if purpose not in PURPOSES:
            raise bad_request(
                f"purpose must be 'batch' (the only purpose served here), got {purpose!r}",
                "purpose",
            )
        record = await files.create(
            await upload.read(),
            upload.filename or "upload",
            purpose,
            caller_name(request),
            _expiry(form),
        )
        return JSONResponse(_view(record))

    @router.get("")
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = DEFAULT_LIST_LIMIT,
        after: str | None = None,
        order: str = "desc",
    ) -> Response:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise bad_request(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
        records, more = await files.objects.list(
            KIND,
            caller_name(request),
            limit,
            id_cursor(after, "after"),
            ascending=order == "asc",
            where=None if purpose is None else lambda record: record["purpose"] == purpose,
        )
        return JSONResponse(list_page([_view(r) for r in records], more))

    @router.get("/{file_id}")
    async def retrieve(file_id: str, request: Request) -> Response:
        return JSONResponse(_view(await files.get(file_id, caller_name(request))))

    @router.get("/{file_id}/content")
    async def content(file_id: str, request: Request) -> Response:
        body = await files.content(file_id, caller_name(request))
        return Response(body, media_type="application/octet-stream")

    @router.delete("/{file_id}")
    async def delete(file_id: str, request: Request) -> Response:
        return JSONResponse(await files.delete(file_id, caller_name(request)))

    return router


def list_page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: ``first_id``, ``last_id``, ``has_more``."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


async def _form(request: Request, raw: bytes) -> Any:
    """The multipart form of an already read (and so bounded) body."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("Content-Type must be multipart/form-data with a file part", "file")
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        return await Request(request.scope, receive).form(max_files=1, max_fields=16)
    except Exception as exc:  # the multipart parser's own errors: a malformed upload
        raise bad_request(f"the multipart body cannot be read: {exc}", "file") from None


def _expiry(form: Any) -> float | None:
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if isinstance(seconds, str) and seconds.isdigit():
        seconds = int(seconds)
    return expiry_seconds({"anchor": anchor, "seconds": seconds}, "expires_after")


def expiry_seconds(value: Any, where: str) -> float | None:
    """OpenAI's ``{"anchor": "created_at", "seconds": N}``, N from 1 hour to 30 days."""
    if value is None:
        return None
    anchor = value.get("anchor") if isinstance(value, dict) else None
    if anchor != "created_at":
        raise bad_request(f"{where}.anchor must be 'created_at', got {anchor!r}", f"{where}.anchor")
    seconds = value.get("seconds")
    if not (
        isinstance(seconds, int)
        and not isinstance(seconds, bool)
        and MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S
    ):
        raise bad_request(
            f"{where}.seconds must be between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}, got {seconds!r}",
            f"{where}.seconds",
        )
    return float(seconds)


def _view(record: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in record.items() if name not in ("owner", "kept_until")}


def _too_large(message: str) -> ApiError:
    return ApiError(413, message, "invalid_request_error", "file", "file_too_large")


def _over_quota(exc: QuotaExceeded) -> ApiError:
    quota = exc.quota
    if exc.held_count + 1 > quota.count:
        return _too_large(
            f"This key holds {exc.held_count} files; a key may hold at most {quota.count} "
            "files (--max-files-per-key): delete some"
        )
    return _too_large(
        f"This key's files would hold {exc.held_bytes + exc.size} bytes; a key's files may "
        f"hold at most {quota.bytes} bytes (--max-file-bytes-per-key): delete some"
    )


__all__ = ["Files", "expiry_seconds", "files_router", "list_page"]
