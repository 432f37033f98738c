"""Bodies the server refuses cheaply: too large (413), too deep or not JSON (400), never a 500."""

from __future__ import annotations

import httpx
import pytest

from api.request_body import DEFAULT_MAX_BODY_BYTES

JSON_ROUTES = [
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/tokenize",
    "/v1/jobs",
    "/v1/jobs/batch",
]


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_json_nested_past_the_limit_is_a_400_on_every_route(http: httpx.Client, path: str):
    deep = b'{"a": ' * 1000 + b"1" + b"}" * 1000
    reply = http.post(path, content=deep, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert "nest" in reply.text.lower()


@pytest.mark.parametrize(
    ("path", "error_type"),
    [("/v1/chat/completions", "invalid_request_error"), ("/v1/messages", "request_too_large")],
)
def test_a_body_over_the_limit_is_a_413_in_the_protocols_shape(
    http: httpx.Client, path: str, error_type: str
):
    body = b'{"model": "default", "messages": "' + b"x" * DEFAULT_MAX_BODY_BYTES + b'"}'
    reply = http.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == error_type

    def chunks():  # no Content-Length: refused as it streams in
        yield b'{"model": "default", "messages": "'
        for _ in range(40):
            yield b"x" * 2**20

    streamed = http.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


@pytest.mark.parametrize(
    "body",
    [b'{"model": NaN}', b'{"model": "\\ud800"}', b'{"model": "\xff"}', b"1" * 5000, b"[1,"],
)
def test_json_python_would_accept_or_choke_on_is_a_400(http: httpx.Client, body: bytes):
    reply = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400, reply.text
