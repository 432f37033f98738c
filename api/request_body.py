"""Reading a request's body: a JSON object, or a 400 or 413 that says what is wrong with it.

The body is read in chunks and refused with a 413 as soon as it passes the byte
limit, so a large body is never held whole. It is then parsed as strict JSON:
UTF-8, no ``NaN`` or ``Infinity``, no number too large for a double, no lone
UTF-16 surrogate, and arrays and objects nested at most ``max_depth`` deep.
Every way a body can fail ends in an ``ApiError``, never in an exception the
server would answer with a 500.

Depth is checked on the parsed value, one level at a time, without recursion: a
chat request holds a few hundred values, so the walk costs well under a
millisecond, where a scan of the raw bytes for brackets outside strings cost
more than the parse itself on a 32 MiB body. A document nested deeper than the
interpreter's recursion limit stops the parser with a ``RecursionError``, which
gets the same 400. JSON must be UTF-8 (RFC 8259); a leading byte order mark is
skipped, UTF-16 and UTF-32 are refused. A body over ``LARGE_BODY_BYTES`` is parsed
on a thread, so the event loop goes on serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Iterable
from itertools import chain
from typing import Any

from fastapi import Request

from api.errors import ApiError, bad_request
from shared.heap import paused_collection

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
# A larger body is parsed on a thread, object by object: parsing a 16 MiB batch of requests
# in one call of the C parser holds the interpreter, and so every other request, for 0.5 s.
LARGE_BODY_BYTES = 2**20
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_DEPTH = 64

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(
    request: Request,
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> dict[str, Any]:
    """The body as a JSON object; a 400 for anything else, a 413 past ``max_bytes``."""
    body = await read_json_value(request, max_bytes, max_depth, timeout_s)
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


async def read_json_value(
    request: Request,
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> Any:
    """The body as any JSON value (an array of jobs, say), with ``read_json``'s checks."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise bad_request(f"Content-Type must be application/json, got {content_type!r}")
    raw = await read_body(request, max_bytes, timeout_s)
    if len(raw) <= LARGE_BODY_BYTES:
        return parse_json(raw, max_depth)
    return await asyncio.to_thread(_parse_large, raw, max_depth)


async def read_body(
    request: Request,
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> bytes:
    """The raw body, at most ``max_bytes`` of it; a 413 before reading more than one chunk past.

    A declared ``Content-Length`` over the limit is refused before anything is
    read. A body that has not all arrived ``timeout_s`` after the route began
    reading it is a 408: a client that sends slowly holds no place for long.
    """
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes:
        raise _too_large(f"is {declared} bytes (its Content-Length)", max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(f"has passed {max_bytes} bytes", max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408,
            f"The request body did not arrive within {timeout_s:g}s ({size} bytes came).",
            "invalid_request_error",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


def _declared_length(request: Request) -> int | None:
    """``Content-Length``, or ``None`` when absent or malformed (the stream is counted anyway)."""
    digits = request.headers.get("content-length", "").strip()
    if not (digits.isascii() and digits.isdigit()):
        return None
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else sys.maxsize


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH, yielding: bool = False) -> Any:
    """``raw`` as strict JSON (see the module's docstring); a 400 naming the first fault.

    ``yielding`` builds each object in Python, so that a thread parsing a large body
    lets the event loop's thread run between objects (the C parser alone holds the
    interpreter for the whole document).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start]
        raise bad_request(
            f"The request body is not valid UTF-8: byte 0x{byte:02x} at offset {exc.start}"
        ) from None
    try:
        value = json.loads(
            text.removeprefix("\ufeff"),
            parse_constant=_refuse_constant,
            parse_float=_finite,
            object_pairs_hook=yielding_object if yielding else None,
        )
    except RecursionError:
        raise _too_deep(max_depth) from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except ValueError:
        # The one other ValueError the parser raises: int() past its digit limit.
        digits = sys.get_int_max_str_digits()
        raise bad_request(
            f"The request body holds an integer of more than {digits} digits; "
            f"integers of at most {digits} digits are accepted"
        ) from None
    # Valid UTF-8 decodes to no surrogate; only a \uD800-\uDFFF escape can make one.
    _check_tree(value, max_depth, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


def _parse_large(raw: bytes, max_depth: int) -> Any:
    """A large body, object by object, with the collector paused: it could free none of the
    objects the parse builds, and would walk them all each time they grow by a quarter."""
    with paused_collection():
        return parse_json(raw, max_depth, yielding=True)


def yielding_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as ``json.loads`` builds it, in Python code: the interpreter may switch
    threads here, which it never does inside the C parser."""
    return dict(pairs)


def _check_tree(value: Any, max_depth: int, strings: bool) -> None:
    """Refuse nesting past ``max_depth`` and, when ``strings``, lone surrogates; no recursion.

    One level at a time: ``level`` holds the arrays and objects ``depth`` deep.
    """
    if strings:
        _check_strings([value])
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise _too_deep(max_depth)
        groups = [node.values() if isinstance(node, dict) else node for node in level]
        if strings:
            _check_strings(chain.from_iterable(node for node in level if isinstance(node, dict)))
            _check_strings(chain.from_iterable(groups))
        level = [item for item in chain.from_iterable(groups) if isinstance(item, (dict, list))]


def _check_strings(values: Iterable[Any]) -> None:
    for value in values:
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")  # twice as fast as searching for the surrogate range
            except UnicodeEncodeError as exc:
                raise bad_request(
                    f"The request body holds a lone UTF-16 surrogate "
                    f"\\u{ord(value[exc.start]):04x} in a string; escape a character outside "
                    "the Basic Multilingual Plane as a surrogate pair (\\ud83d\\ude00) "
                    "or send it as UTF-8"
                ) from None


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise bad_request(
            f"The request body holds the number {text[:40]}, too large for a double; "
            "numbers must be finite"
        )
    return number


def _refuse_constant(name: str) -> Any:
    raise bad_request(
        f"The request body holds {name}, which is not JSON; send a finite number or null"
    )


def _too_deep(max_depth: int) -> ApiError:
    return bad_request(
        f"The request body nests arrays and objects more than {max_depth} deep; "
        f"at most {max_depth} levels are accepted"
    )


def _too_large(size: str, max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"The request body {size}; this server accepts at most {max_bytes} bytes",
        "invalid_request_error",
        code="request_too_large",
    )
