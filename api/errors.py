"""Errors the API answers with, independent of the protocol's error shape.

Each protocol renders an ``ApiError`` in its own shape (OpenAI's
``{"error": {...}}`` or Anthropic's ``{"type": "error", ...}``); raising code
only says what went wrong and which status it deserves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    @property
    def retry_after_s(self) -> float | None:
        """When a retry may succeed, from ``Retry-After`` (or its milliseconds twin); None: the
        error says retrying does not help, so the request must change first."""
        headers = {name.lower(): value for name, value in (self.headers or {}).items()}
        for name, scale in (("retry-after-ms", 1000), ("retry-after", 1)):
            try:
                return float(headers[name]) / scale
            except (KeyError, ValueError):
                continue
        return None


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the offending field, e.g. ``bad_request("... got -1", "temperature")``."""
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None) -> ApiError:
    return ApiError(404, message, "not_found_error", param, "model_not_found")


def overloaded(message: str, retry_after: int = 1) -> ApiError:
    return ApiError(503, message, "overloaded_error", None, None, {"Retry-After": str(retry_after)})
