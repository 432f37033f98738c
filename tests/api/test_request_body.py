"""Reading a request's body: the byte limit while it streams in, and strict JSON.

A tiny app with one route that calls ``read_json`` stands in for the protocol
routes; its error handler renders an ``ApiError`` in OpenAI's shape, as the
server does on the OpenAI paths. Bodies are sent by an async generator that
counts what it yields, so a test can show how much of a body was read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import ApiError
from api.protocols.openai_common import error_body
from api.request_body import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    parse_json,
    read_json,
    read_json_value,
)

LIMIT = 1024
CHUNK = 100


def make_app() -> FastAPI:
    app = FastAPI()

    @app.post("/object")
    async def read_object(request: Request) -> dict[str, Any]:
        body = await read_json(request, max_bytes=LIMIT)
        return {"keys": sorted(body), "body": body}

    @app.post("/default-limits")
    async def read_with_defaults(request: Request) -> dict[str, Any]:
        return {"keys": sorted(await read_json(request))}

    @app.post("/value")
    async def read_value(request: Request) -> dict[str, Any]:
        return {"value": await read_json_value(request, max_bytes=LIMIT)}

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(error_body(exc), status_code=exc.status)

    app.add_exception_handler(ApiError, api_error)
    return app


APP = make_app()


class CountingBody:
    """An async body of ``size`` bytes in ``CHUNK``-byte pieces that counts what was taken."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.taken = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start in range(0, len(self.data), CHUNK):
            piece = self.data[start : start + CHUNK]
            self.taken += len(piece)
            yield piece


def post(content: bytes | CountingBody, path: str = "/object", **headers: str) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=APP)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=content, headers=headers)

    return asyncio.run(send())


def padded(size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes."""
    frame = b'{"pad": ""}'
    return frame[:-2] + b"x" * (size - len(frame)) + frame[-2:]


def nested(depth: int) -> bytes:
    """An object holding arrays, ``depth`` arrays and objects deep in all."""
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def error(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


# --- the byte limit ---------------------------------------------------------------


def test_the_defaults_are_32_mib_and_64_levels() -> None:
    assert DEFAULT_MAX_BODY_BYTES == 32 * 2**20
    assert MAX_JSON_DEPTH == 64


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    body = CountingBody(padded(LIMIT + 1))
    response = post(body, **{"content-length": str(LIMIT + 1)})
    assert response.status_code == 413
    assert error(response)["type"] == "invalid_request_error"
    assert error(response)["code"] == "request_too_large"
    assert f"{LIMIT + 1} bytes" in error(response)["message"]
    assert f"at most {LIMIT} bytes" in error(response)["message"]
    assert body.taken == 0


def test_an_absurd_declared_length_is_a_413() -> None:
    response = post(padded(10), **{"content-length": "9" * 5000})
    assert response.status_code == 413


def test_a_streamed_body_over_the_limit_stops_one_chunk_past_it() -> None:
    body = CountingBody(padded(100 * LIMIT))
    response = post(body)
    assert response.status_code == 413
    assert f"at most {LIMIT} bytes" in error(response)["message"]
    assert LIMIT < body.taken <= LIMIT + CHUNK


@pytest.mark.parametrize("streamed", [False, True])
def test_a_body_of_exactly_the_limit_is_read(streamed: bool) -> None:
    data = padded(LIMIT)
    response = post(CountingBody(data) if streamed else data)
    assert response.status_code == 200
    assert response.json()["keys"] == ["pad"]


def test_any_json_value_can_be_read() -> None:
    assert post(b"[1, 2]", "/value").json() == {"value": [1, 2]}


def test_another_content_type_is_refused() -> None:
    response = post(b"{}", **{"content-type": "text/plain"})
    assert response.status_code == 400
    assert "text/plain" in error(response)["message"]


# --- nesting ----------------------------------------------------------------------


def test_nesting_up_to_the_limit_is_read_and_one_deeper_is_a_400() -> None:
    assert post(nested(MAX_JSON_DEPTH)).status_code == 200
    response = post(nested(MAX_JSON_DEPTH + 1))
    assert response.status_code == 400
    assert f"more than {MAX_JSON_DEPTH} deep" in error(response)["message"]


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_nesting_past_the_recursion_limit_is_a_400(depth: int) -> None:
    for raw in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        with pytest.raises(ApiError) as caught:
            parse_json(raw)
        assert caught.value.status == 400
        assert f"more than {MAX_JSON_DEPTH} deep" in caught.value.message


def test_an_unclosed_deep_prefix_is_a_400() -> None:
    with pytest.raises(ApiError) as caught:
        parse_json(b"[" * 100_000)
    assert caught.value.status == 400


def test_the_depth_limit_is_a_parameter() -> None:
    assert parse_json(b"[[1]]", max_depth=2) == [[1]]
    with pytest.raises(ApiError):
        parse_json(b"[[[1]]]", max_depth=2)


# --- strict JSON --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b'{"t": NaN}', "NaN"),
        (b'{"t": Infinity}', "Infinity"),
        (b'{"t": [-Infinity]}', "-Infinity"),
        (b'{"t": 1e999}', "1e999"),
        (b'{"t": -1.5e400}', "-1.5e400"),
        (b'{"n": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"s": "caf\xe9"}', "0xe9"),
        (b'{"s": "\xed\xa0\x80"}', "UTF-8"),
        (b'{"s": "\\ud800"}', "\\ud800"),
        (b'{"s": "\\udc00 low"}', "\\udc00"),
        (b'{"s": "\\ud83d\\ud83d\\ude00"}', "\\ud83d"),
        (b'{"\\udfff": 1}', "\\udfff"),
        ('{"s": 1}'.encode("utf-16"), "UTF-8"),
        (b'{"s": }', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_what_json_or_python_would_mishandle_is_a_400(raw: bytes, named: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json(raw)
    assert caught.value.status == 400
    assert named in caught.value.message


def test_refusals_reach_the_client_as_400s() -> None:
    for raw in (b'{"t": NaN}', b'{"n": ' + b"1" * 5000 + b"}", b'{"s": "\\ud800"}', b"\xff"):
        response = post(raw, "/default-limits")
        assert response.status_code == 400, raw
        assert error(response)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"s": "\\ud83d\\ude00"}', {"s": "\U0001f600"}),
        (b'{"s": "\\uD83D\\uDE00"}', {"s": "\U0001f600"}),
        (b'{"s": "\\\\ud800"}', {"s": "\\ud800"}),
        (b'{"s": "\xf0\x9f\x98\x80 caf\xc3\xa9"}', {"s": "\U0001f600 café"}),
        (b'\xef\xbb\xbf{"bom": 1}', {"bom": 1}),
        (b'{"a": 1, "a": 2}', {"a": 2}),
        (b'{"n": 1e308, "i": ' + b"9" * 4000 + b"}", {"n": 1e308, "i": int("9" * 4000)}),
    ],
)
def test_valid_json_reads_as_it_always_did(raw: bytes, value: Any) -> None:
    assert parse_json(raw) == value


def test_a_body_that_is_not_an_object_is_a_400() -> None:
    response = post(b"[1]")
    assert response.status_code == 400
    assert "got list" in error(response)["message"]


# --- properties ---------------------------------------------------------------------

TOKENS = st.sampled_from(
    [b"[", b"]", b"{", b"}", b'"', b":", b",", b"\\", b"\\u", b"d800", b"dc00", b"\\\\", b'\\"']
    + [b"1", b"-0", b"1e999", b"9" * 4400, b".5", b"NaN", b"Infinity", b"true", b"null", b" "]
    + [b"\xff", b"\xed\xa0\x80", b"\xc3\xa9", b"\xf0\x9f\x98\x80", b"\xef\xbb\xbf", b"a"]
)
JSON_ISH = st.lists(TOKENS, max_size=60).map(b"".join) | st.binary(max_size=200)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSON_ISH)
def test_any_bytes_read_as_json_or_a_400(raw: bytes) -> None:
    try:
        parse_json(raw)
    except ApiError as exc:
        assert exc.status == 400


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES, st.booleans())
def test_json_within_the_limits_reads_back_as_sent(value: Any, ascii_only: bool) -> None:
    assert parse_json(json.dumps(value, ensure_ascii=ascii_only).encode()) == value


@settings(max_examples=30, deadline=None)
@given(JSON_ISH)
def test_any_body_through_a_route_is_answered_200_400_or_413(raw: bytes) -> None:
    assert post(raw).status_code in (200, 400, 413)
