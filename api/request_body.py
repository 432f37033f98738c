"""Reading a request's body: a JSON object, or a 400 that says what is wrong with it."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from api.errors import bad_request


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; a 400 for another content type or malformed JSON."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise bad_request(f"Content-Type must be application/json, got {content_type!r}")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}")
    return body
