"""Request ids on every answer, and requests whose client left counted as such."""

from __future__ import annotations

import re
import time

import httpx

BODY = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_a_well_formed_request_id_is_kept_and_any_other_replaced(http: httpx.Client):
    kept = http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "trace-42.a"})
    assert kept.headers["x-request-id"] == "trace-42.a"
    for sent in ({}, {"x-request-id": "no spaces allowed"}, {"x-request-id": "x" * 129}):
        fresh = http.post("/v1/chat/completions", json=BODY, headers=sent)
        assert re.fullmatch(r"req_[0-9a-f]{24}", fresh.headers["x-request-id"])
    refused = http.post("/v1/chat/completions", json={"model": "default"})
    assert refused.status_code == 400 and refused.headers["x-request-id"].startswith("req_")


def _left(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    line = re.search(
        r'sluice_requests_total\{protocol="chat.completions",status="499"\} (\S+)', metrics
    )
    return float(line.group(1)) if line else 0.0


def test_a_stream_whose_client_left_counts_as_499_not_200(http: httpx.Client):
    before = _left(http)
    body = {**BODY, "max_tokens": 200, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        next(stream.iter_lines())  # the first event, then the client goes
    deadline = time.monotonic() + 20
    while _left(http) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left(http) == before + 1
